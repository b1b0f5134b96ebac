#include "optfuse/dtype.h"

#include <cmath>
#include <cstring>

#include "ir/low_precision.h"
#include "optfuse/error.h"

namespace optfuse {

DType parse_dtype(const std::string& n) {
  if (n == "float32" || n == "f32" || n == "fp32" || n == "float") return DType::f32;
  if (n == "float16" || n == "f16" || n == "fp16" || n == "half") return DType::f16;
  if (n == "bfloat16" || n == "bf16") return DType::bf16;
  if (n == "int16" || n == "i16") return DType::i16;
  if (n == "float64" || n == "f64" || n == "fp64" || n == "double") return DType::f64;
  if (n == "q8" || n == "int8") return DType::q8;
  throw Error("unknown dtype '" + n + "' (expected float32, float64, float16, bfloat16, int16 or q8)");
}

uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 conversions, written out because C++17 has no portable half type.
uint16_t float_to_f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (mag < 0x38800000u) {  // subnormal or zero in half: scale by 2^24 and round via float add
    float a;
    uint32_t m = mag;
    std::memcpy(&a, &m, 4);
    a = a + 0.5f;  // 0.5 = 2^-1: puts the half-subnormal ulp (2^-24) in the float's last place
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  uint32_t odd = (mag >> 13) & 1u;
  mag += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (mag >> 13));
}

float f16_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
    if (sign) f = -f;
    return f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

double load_element(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::i16: return static_cast<const int16_t*>(base)[i];
    case DType::f64: return static_cast<const double*>(base)[i];
    case DType::q8: throw Error("load_element: a q8 element needs its buffer's size (load_q8_element)");
  }
  return 0;
}

double load_q8_element(const void* base, int64_t n, int64_t i) {
  const auto* bytes = static_cast<const unsigned char*>(base);
  float scale;
  std::memcpy(&scale, bytes + q8_scales_offset(n) + 4 * (i / kQ8Block), 4);
  return lowp::q8_decode(static_cast<signed char>(bytes[i]), scale);
}

void store_q8_block(void* base, int64_t n, int64_t first, int64_t count, const double* values) {
  auto* bytes = static_cast<unsigned char*>(base);
  float scale = 0.0f;
  for (int64_t k = 0; k < count; ++k) scale = lowp::q8_fold_scale(scale, static_cast<float>(values[k]));
  std::memcpy(bytes + q8_scales_offset(n) + 4 * (first / kQ8Block), &scale, 4);
  for (int64_t k = 0; k < count; ++k)
    bytes[first + k] = static_cast<unsigned char>(static_cast<signed char>(lowp::q8_encode(static_cast<float>(values[k]), scale)));
}

void store_element(void* base, DType t, int64_t i, double v) {
  if (t == DType::f64) {  // unrounded
    static_cast<double*>(base)[i] = v;
    return;
  }
  float f = static_cast<float>(v);
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = f; break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16_bits(f); break;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(f); break;
    case DType::i16: static_cast<int16_t*>(base)[i] = static_cast<int16_t>(std::lrint(std::fmin(std::fmax(v, -32768.0), 32767.0))); break;
    case DType::f64: break;
    case DType::q8: throw Error("store_element: q8 is stored a block at a time (store_q8_block)");
  }
}

}  // namespace optfuse
