// Element types of stored tensors. Math on elements is float32 (low-precision storage is widened on
// load and rounded on store: to nearest-even, or stochastically where a buffer asks for it), except
// for a tensor with a float64 role, whose element math is float64 (as torch computes in the
// parameter's dtype); scalar math is float64. int16 holds only the remainders of master weights
// (plan options): integers, loaded as their value and stored exactly. q8 is a block-quantized
// 8-bit storage for rule states (issue 34; its format below). The codes are stable (the Python
// front end maps torch dtypes to them): new dtypes are appended.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace optfuse {

enum class DType : uint8_t { f32 = 0, f16 = 1, bf16 = 2, i16 = 3, f64 = 4, q8 = 5 };
constexpr int kNumDTypes = 6;

// Bytes of one element (q8: its code; the block scales come on top, q8_storage_bytes).
inline size_t dtype_size(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : t == DType::q8 ? 1 : 2; }

// q8, block-quantized 8-bit state storage. A buffer of n elements is one allocation of
// q8_storage_bytes(n) bytes: n signed 8-bit codes, padding to a 16-byte boundary, then one float32
// scale per block of kQ8Block elements (the block's largest finite |value|). Blocks start at the
// buffer's first element, so a buffer cut at multiples of kQ8Block (chunks, ZeRO pieces) holds the
// same blocks as the whole one. Code q in [-127, 127] stands for sign(q) * scale * (|q|/127)^4
// (power-law companding: at code c the error is at most 2/c of the value, 1.6% at the block's
// largest value, 2.8% at a tenth of it, 16% at 1e-4 of it, and values down to 2.4e-10 of it keep a
// non-zero code, which a second moment's small values need), -128 for NaN (also what an infinite
// value is stored as). Encoding rounds to the nearest code in the companded domain. One definition of both directions, shared by the
// host and the generated code: src/ir/low_precision_code.h.
constexpr int64_t kQ8Block = 256;
constexpr int64_t kQ8ScalesAlign = 16;  // the scales start at a multiple of this many bytes
inline int64_t q8_blocks(int64_t n) { return (n + kQ8Block - 1) / kQ8Block; }
inline int64_t q8_scales_offset(int64_t n) { return (n + kQ8ScalesAlign - 1) / kQ8ScalesAlign * kQ8ScalesAlign; }
inline int64_t q8_storage_bytes(int64_t n) { return q8_scales_offset(n) + 4 * q8_blocks(n); }
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i16: return "int16";
    case DType::f64: return "float64";
    case DType::q8: return "q8";
  }
  return "?";
}
// A float type of low precision (float16, bfloat16): what rounding modes and master weights apply to.
inline bool dtype_is_low_precision_float(DType t) { return t == DType::f16 || t == DType::bf16; }
// Accepts "float64"/"f64"/"fp64"/"double", "float32"/"f32"/"fp32", "float16"/"f16"/"fp16"/"half", "bfloat16"/"bf16", "int16"/"i16",
// "q8"/"int8" (block-quantized);
// throws optfuse::Error.
DType parse_dtype(const std::string& name);

// Scalar conversions shared by the reference evaluator, the CPU fallback and tests (the generated
// code carries its own copies in each dialect's prelude). Rounding is to nearest, ties to even;
// NaN stays NaN.
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);

// Load element i of a tensor of type t as double / store a double rounded to t (not q8: its
// stores are per block).
double load_element(const void* base, DType t, int64_t i);
void store_element(void* base, DType t, int64_t i, double v);
// q8 buffers of n elements: element i, and a whole block [first, first + count) (first a multiple
// of kQ8Block, count up to kQ8Block, the last block of the buffer may be shorter) encoded from
// `values` with its new scale.
double load_q8_element(const void* base, int64_t n, int64_t i);
void store_q8_block(void* base, int64_t n, int64_t first, int64_t count, const double* values);

}  // namespace optfuse
