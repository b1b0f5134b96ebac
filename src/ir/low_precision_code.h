// Low-precision storage helpers written ONCE, as a macro, so that the same text is both compiled
// into the library (src/ir/low_precision.cpp: the reference evaluator and host code) and printed
// into every generated kernel's prelude (src/codegen/low_precision_source.cpp stringifies it).
// Stochastic rounding and master-weight remainders must agree bit for bit between the reference
// evaluator, the CPU and the CUDA backends; one definition makes that true by construction.
//
// Rules for the code below (it is a macro): C comments only, no preprocessor lines, and only
// the prelude's helpers of_f2u, of_u2f, of_float_to_bf16, of_float_to_f16, of_f16_to_float.
// OF_FN is the dialect's function qualifier (inline on the host, __device__ on CUDA).
//
// Stochastic rounding. The random bits of one store are a counter-based hash of (tensor key,
// element index, step, role): splitmix64 of (key, step) once per chunk, then one 32-bit hash per
// element (of its index modulo 2^32) that every role of the element shares, each role multiplying
// it by its own odd constant and rounding with the product's high bits (bfloat16 16 of them,
// float16 24). The integer work per element is what bounds a stochastic kernel on an H200: two
// hashes per element (one per pair of roles) and the element's full 64-bit index ran AdamW at
// 81.7% of its floor, this at 85.7% (docs/performance.md). In a tensor of more than 2^32 elements,
// elements 2^32 apart draw the same bits: each rounding stays unbiased. No generator state: the
// same bits on every backend, for any thread, block or chunk count, and for any cut of a tensor
// into shards (an element's index is its index in the whole tensor: rng_offset + position).
//   of_rng_base(key, step)      once per chunk: the tensor's stream at this step
//   of_rng_bits(base, e, role)  32 random bits for element e of role `role` (use the high ones)
// bfloat16: add 16 random bits below the kept 16, then truncate: rounds up with probability
// (dropped bits) / 2^16, so E[result] = x exactly (unbiased); inf stays inf, NaN becomes a quiet
// NaN (as nearest rounding). float16: the two neighbours of x, the upper one with probability
// (x - lo) / (hi - lo), from 24 random bits; non-finite values, and values a float16 cannot bracket
// (beyond its largest finite), round to nearest.
//
// Master-weight remainders (Megatron's store_param_remainders): an fp32 master m is kept as its
// bfloat16 parameter p = the upper 16 bits of m, rounded to nearest (ties away from zero: the
// low half >= 0x8000 rounds the magnitude up), and the int16 remainder r = the low 16 bits of m
// read as a signed number. m is rebuilt exactly: upper = bits(p) >> 16, minus one where r < 0.
// NaN and infinity keep their upper half (a NaN's payload is not preserved).
//
// q8 block-quantized states (optfuse/dtype.h has the storage format): a block's scale is the
// largest finite |x| of its new values (of_q8_fold_scale from 0, in any order: a max is exact);
// code q = sign(x) * rint(127 * (|x| / scale)^(1/4)), -128 for a non-finite x; the value of q is
// sign(q) * scale * (|q|/127)^4. Only IEEE multiplies, a division and square roots, none feeding
// an add (nothing a compiler may contract into an fma), so every backend gets the same bits.
#pragma once

#define OF_LOW_PRECISION_CODE                                                                      \
  OF_FN unsigned long long of_mix64(unsigned long long z) {                                        \
    z ^= z >> 30;                                                                                  \
    z *= 0xbf58476d1ce4e5b9ull;                                                                    \
    z ^= z >> 27;                                                                                  \
    z *= 0x94d049bb133111ebull;                                                                    \
    return z ^ (z >> 31);                                                                          \
  }                                                                                                \
  OF_FN unsigned long long of_rng_base(unsigned long long key, unsigned long long step) {          \
    return of_mix64(key ^ of_mix64(step + 0x9e3779b97f4a7c15ull));                                 \
  }                                                                                                \
  OF_FN unsigned of_rng_element(unsigned long long base, unsigned long long element) {               \
    /* 32-bit arithmetic only (a 64-bit multiply is several instructions on a GPU, where this is */ \
    /* integer-bound): the element index modulo 2^32, two odd multipliers and one xor-shift. The */ \
    /* stores take the high bits of the result, which mix every input bit. */                       \
    unsigned x = ((unsigned)element ^ (unsigned)base) * 0x9e3779b1u;                               \
    x ^= x >> 16;                                                                                  \
    return x * 0x85ebca6bu;                                                                        \
  }                                                                                                \
  OF_FN unsigned of_rng_bits(unsigned long long base, unsigned long long element, int role) {      \
    /* one hash per element, shared by every role (the compiler computes it once per element); */  \
    /* role k multiplies it by its own odd constant (role 0 by 1): the product's high bits, */      \
    /* which the stores use, mix every bit of the hash, and each is uniform (an odd multiplier */   \
    /* is a bijection of 32-bit words) */                                                          \
    return of_rng_element(base, element) * (1u + (unsigned)role * 0x9e3779b8u);                    \
  }                                                                                                \
  OF_FN unsigned short of_float_to_bf16_sr(float f, unsigned r) {                                  \
    unsigned u = of_f2u(f);                                                                        \
    /* NaN: quiet, as nearest rounding makes it; otherwise add 16 random bits below the kept */   \
    /* ones (the high 16 of r; inf has none, so it stays inf; a carry rounds the magnitude up, */  \
    /* past the largest finite to inf) */                                                         \
    u = f != f ? (u | 0x400000u) : u + (r >> 16);                      \
    return (unsigned short)(u >> 16);                                                              \
  }                                                                                                \
  OF_FN unsigned short of_float_to_f16_sr(float f, unsigned r) {                                   \
    unsigned short n = of_float_to_f16(f);                                                         \
    float fn = of_f16_to_float(n);                                                                 \
    if (fn == f || f != f || (n & 0x7c00u) == 0x7c00u) return n; /* exact, NaN, overflow */       \
    /* the neighbour of n on the other side of f: one step of the magnitude (sign-magnitude) */   \
    unsigned short m = (unsigned short)(((fn < 0.0f ? -fn : fn) > (f < 0.0f ? -f : f)) ? n - 1 : n + 1); \
    if ((m & 0x7c00u) == 0x7c00u) return n;                                                        \
    float fm = of_f16_to_float(m);                                                                 \
    float lo = fn < fm ? fn : fm, hi = fn < fm ? fm : fn;                                          \
    float p = (f - lo) / (hi - lo); /* exact operands: f and lo are within a factor of 2 */      \
    float u = (float)(r >> 8) * 5.9604644775390625e-8f; /* uniform in [0, 1), 24 bits */           \
    float pick = u < p ? hi : lo;                                                                  \
    return pick == fn ? n : m;                                                                     \
  }                                                                                                \
  OF_FN float of_master_from_remainder(float param, float remainder) {                             \
    int r = (int)remainder;                                                                        \
    unsigned upper = of_f2u(param) >> 16;                                                          \
    if (r < 0) upper -= 1u;                                                                        \
    return of_u2f((upper << 16) | ((unsigned)r & 0xffffu));                                        \
  }                                                                                                \
  OF_FN float of_remainder_of_master(float master) {                                               \
    unsigned low = of_f2u(master) & 0xffffu;                                                       \
    return (float)(low >= 0x8000u ? (int)low - 0x10000 : (int)low);                                \
  }                                                                                                \
  OF_FN float of_param_of_master(float master) {                                                   \
    unsigned u = of_f2u(master), upper = u >> 16;                                                  \
    if ((u & 0x7f800000u) == 0x7f800000u) {                                                        \
      if (u & 0x7fffffu) upper |= 0x40u; /* NaN stays NaN */                                       \
    } else if (u & 0x8000u) {                                                                      \
      upper += 1u;                                                                                 \
    }                                                                                              \
    return of_u2f(upper << 16);                                                                    \
  }                                                                                                \
  OF_FN float of_q8_fold_scale(float scale, float x) {                                             \
    float a = x < 0.0f ? -x : x;                                                                   \
    return (a - a == 0.0f && a > scale) ? a : scale; /* finite values only */                     \
  }                                                                                                \
  OF_FN int of_q8_encode(float x, float scale) {                                                   \
    if (!(x - x == 0.0f)) return -128; /* NaN or infinite */                                      \
    float a = x < 0.0f ? -x : x;                                                                   \
    float t = scale > 0.0f ? a / scale : 0.0f;                                                     \
    int q = (int)rintf(sqrtf(sqrtf(t)) * 127.0f);                                                  \
    return x < 0.0f ? -q : q;                                                                      \
  }                                                                                                \
  OF_FN float of_q8_decode(int q, float scale) {                                                   \
    if (q == -128) return of_u2f(0x7fc00000u);                                                     \
    float a = (float)(q < 0 ? -q : q) * (1.0f / 127.0f);                                           \
    float a2 = a * a;                                                                              \
    float v = a2 * a2 * scale;                                                                     \
    return q < 0 ? -v : v;                                                                         \
  }
