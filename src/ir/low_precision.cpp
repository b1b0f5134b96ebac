#include "ir/low_precision.h"

#include <cmath>
#include <cstring>

#include "ir/low_precision_code.h"
#include "optfuse/error.h"

namespace optfuse::lowp {

namespace {

// The prelude helpers the shared code calls, on the host.
inline unsigned of_f2u(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float of_u2f(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned short of_float_to_bf16(float f) { return float_to_bf16_bits(f); }
inline unsigned short of_float_to_f16(float f) { return float_to_f16_bits(f); }
inline float of_f16_to_float(unsigned short h) { return f16_bits_to_float(h); }

#define OF_FN inline
OF_LOW_PRECISION_CODE
#undef OF_FN

}  // namespace

uint64_t rng_base(uint64_t key, uint64_t step) { return of_rng_base(key, step); }
uint32_t rng_bits(uint64_t base, uint64_t element, int role) { return of_rng_bits(base, element, role); }
uint16_t float_to_bf16_sr(float x, uint32_t r) { return of_float_to_bf16_sr(x, r); }
uint16_t float_to_f16_sr(float x, uint32_t r) { return of_float_to_f16_sr(x, r); }
float master_from_remainder(float param, float remainder) { return of_master_from_remainder(param, remainder); }
float remainder_of_master(float master) { return of_remainder_of_master(master); }
float param_of_master(float master) { return of_param_of_master(master); }
float q8_fold_scale(float scale, float x) { return of_q8_fold_scale(scale, x); }
int q8_encode(float x, float scale) { return of_q8_encode(x, scale); }
float q8_decode(int q, float scale) { return of_q8_decode(q, scale); }

void store_element_sr(void* base, DType t, int64_t i, double v, uint32_t r) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::bf16: static_cast<uint16_t*>(base)[i] = of_float_to_bf16_sr(f, r); return;
    case DType::f16: static_cast<uint16_t*>(base)[i] = of_float_to_f16_sr(f, r); return;
    default: throw Error(std::string("stochastic rounding applies to float16 and bfloat16 buffers, not ") + dtype_name(t));
  }
}

}  // namespace optfuse::lowp
