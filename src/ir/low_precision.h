// Low-precision storage on the host: stochastic rounding and master-weight remainders, compiled
// from the same text the generated kernels carry (low_precision_code.h), so host and device agree
// bit for bit. Used by the reference evaluator and by tests.
#pragma once
#include <cstdint>

#include "optfuse/dtype.h"

namespace optfuse::lowp {

uint64_t rng_base(uint64_t key, uint64_t step);
uint32_t rng_bits(uint64_t base, uint64_t element, int role);
// x rounded stochastically to bfloat16 / float16 with random bits r (bit patterns).
uint16_t float_to_bf16_sr(float x, uint32_t r);
uint16_t float_to_f16_sr(float x, uint32_t r);
// Stores v to element i of a float16/bfloat16 buffer rounded stochastically with random bits r.
void store_element_sr(void* base, DType t, int64_t i, double v, uint32_t r);
// Master-weight remainders (low_precision_code.h): values, not bit patterns.
float master_from_remainder(float param, float remainder);
float remainder_of_master(float master);
float param_of_master(float master);
// q8 block quantization (optfuse/dtype.h): a block's scale folded over its values, a value's code
// under a scale, a code's value.
float q8_fold_scale(float scale, float x);
int q8_encode(float x, float scale);
float q8_decode(int q, float scale);

}  // namespace optfuse::lowp
