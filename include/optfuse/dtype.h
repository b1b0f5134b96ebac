// Element types of stored tensors. Math on elements is float32 (low-precision storage is widened on
// load and rounded on store: to nearest-even, or stochastically where a buffer asks for it), except
// for a tensor with a float64 role, whose element math is float64 (as torch computes in the
// parameter's dtype); scalar math is float64. int16 holds only the remainders of master weights
// (plan options): integers, loaded as their value and stored exactly. The codes are stable (the
// Python front end maps torch dtypes to them): new dtypes are appended.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace optfuse {

enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2, i16 = 3, f64 = 4 };
constexpr int kNumDTypes = 5;

inline size_t dtype_size(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i16: return "int16";
    case DType::f64: return "float64";
  }
  return "?";
}
// A float type of low precision (float16, bfloat16): what rounding modes and master weights apply to.
inline bool dtype_is_low_precision_float(DType t) { return t == DType::f16 || t == DType::bf16; }
// Accepts "float64"/"f64"/"fp64"/"double", "float32"/"f32"/"fp32", "float16"/"f16"/"fp16"/"half", "bfloat16"/"bf16", "int16"/"i16";
// throws optfuse::Error.
DType parse_dtype(const std::string& name);

// Scalar conversions shared by the reference evaluator, the CPU fallback and tests (the generated
// code carries its own copies in each dialect's prelude). Rounding is to nearest, ties to even;
// NaN stays NaN.
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);

// Load element i of a tensor of type t as double / store a double rounded to t.
double load_element(const void* base, DType t, int64_t i);
void store_element(void* base, DType t, int64_t i, double v);

}  // namespace optfuse
