// The CUDA driver source around the shared printer's functions: one kernel per phase of the plan,
// so a step is one launch per pass over memory (one launch for a plain AdamW step).
//
//   extern "C" __global__ void of_phase<i>(const OfTensor* tensors, const OfChunk* chunks,
//       long long num_chunks, double* table, int groups, double* partials,
//       double* tensor_reductions, int num_tensors, const OfHyperSource* sources,
//       const float* grad_scale, const float* found_inf, unsigned* done_count, int combine_here
//       [, OfMatrixTables mt])   (done_count: cuda_pass_counters() counters)
//
//   1. Uniforms, per block. Every block evaluates every group's uniform values (of_phase<i>_scalars,
//      float64) into dynamic shared memory: hyperparameters from the table or, where a group's
//      hyperparameter is bound to a device scalar (OfHyperSource), from that scalar, so an
//      in-place change made on the stream (a scheduler's lr.fill_, even inside a replayed CUDA
//      graph) is seen by this step; grad_scale / found_inf from device memory; reductions of
//      earlier phases from the table. The step count is read, never written, here: every block sees
//      the same count, and the work is a few double operations per group (no second launch).
//   2. Elements. Each block's first chunk is its own (blockIdx.x); it takes the next ones from a
//      device counter as it gets to them (OF_DYNAMIC_CHUNKS 0: grid-stride instead). Per chunk: the group's derived values go
//      to registers as float, then the tensor's values (of_phase<i>_tensor, float64 from the group's
//      derived values and the tensor's row of tensor_reductions), skipped groups are passed over
//      (update phase), and the chunk loop of the tensor's storage variant (each role's dtype and
//      rounding, codegen/abi.h) runs. Where a head of elements brings every role the phase touches
//      to a 16-byte boundary, the body moves 16-byte vectors (4 floats or 8 16-bit values; a
//      variant mixing sizes moves 8 elements, two vectors of a float32 role; read-only roles
//      through the non-coherent cache), OF_UNROLL_* vectors per role per thread per
//      pass with all of a pass's loads issued before any math; elements before the first boundary
//      and after the last whole vector take a scalar path, as does a chunk whose roles are
//      misaligned differently. Indexing within a tensor is 64-bit (chunk begin), within a chunk
//      32-bit. Reduce phases accumulate in double per thread and per unrolled slot, then reduce the
//      block with a fixed tree into one partial per chunk.
//   3. The last block to finish (a counter, reset by that block, so the kernel can be replayed in a
//      graph) combines this phase's per-chunk partials in chunk order (a fixed strided sum and
//      shuffle tree: bitwise the same every run, no floating-point atomics) into the table for the
//      next phase -- per-tensor reductions per tensor, a warp per tensor over its chunk range
//      (OfTensor::first_chunk, num_chunks) into tensor_reductions[tensor] -- and after the update
//      phase commits the step: skip flags, derived values, step counts and uniform states of every
//      group. Every block's prologue read the old uniform states (the last block runs after every
//      other block passed its prologue), so the commit happens once, here.
//
// Nothing here depends on tensor shapes, the group count or hyperparameter values: the table
// offsets that depend on the group count are computed at run time from `groups`.
#include "codegen/cuda_source.h"

#include <algorithm>
#include <sstream>

#include "codegen/abi.h"
#include "optfuse/error.h"
#include "codegen/c_printer.h"
#include "codegen/cuda_matrix_source.h"

namespace optfuse {

namespace {

// Block size of every kernel; the executor launches exactly this many threads (the deterministic
// reductions depend on it, and the unrolled index arithmetic uses it as a constant).
constexpr int kThreads = 256;

const char* kCudaDriverPrelude = R"(
#define OF_UNIFORM (OF_DERIVED + 1)  // per group in shared memory: derived values, then skip
// (The scalar table's offset functions are printed before this from the plan's ScalarLayout.)

// Storage dtypes (DType codes): 0 float32, 1 float16, 2 bfloat16, 3 int16 (master-weight
// remainders: integers, stored exactly), 4 float64. Conversions use the hardware instructions, which round to
// nearest-even like the prelude's software versions (only NaN payloads may differ); bfloat16
// widening is a shift. of_narrow_sr: stochastic rounding with random bits r (low_precision_code.h).
template <int DT> struct OfStorage { typedef unsigned short E; };
template <> struct OfStorage<0> { typedef float E; };
template <> struct OfStorage<4> { typedef double E; };  // float64: loads and stores of float64 math (of_load1d ...)
// (Without __CUDA_ARCH__, i.e. when a test compiles this source as host C++, the prelude's
// software conversions stand in for the instructions.)
template <int DT> __device__ __forceinline__ float of_widen(typename OfStorage<DT>::E x) {
  if constexpr (DT == 0) {
    return x;
  } else if constexpr (DT == 1) {
#ifdef __CUDA_ARCH__
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
#else
    return of_f16_to_float(x);
#endif
  } else if constexpr (DT == 2) {
    return __uint_as_float((unsigned)x << 16);
  } else {
    return (float)(short)x;
  }
}
template <int DT> __device__ __forceinline__ typename OfStorage<DT>::E of_narrow(float v) {
  if constexpr (DT == 0) {
    return v;
  } else if constexpr (DT == 3) {
    return (unsigned short)(short)(int)v;
  } else {
    unsigned short h;
#ifdef __CUDA_ARCH__
    if constexpr (DT == 1) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    else asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
    h = DT == 1 ? of_float_to_f16(v) : of_float_to_bf16(v);
#endif
    return h;
  }
}
template <int DT> __device__ __forceinline__ typename OfStorage<DT>::E of_narrow_sr(float v, unsigned r) {
  static_assert(DT == 1 || DT == 2, "stochastic rounding is for float16/bfloat16");
  if constexpr (DT == 1) return of_float_to_f16_sr(v, r);
  else return of_float_to_bf16_sr(v, r);
}
template <int DT> __device__ __forceinline__ float of_load1(const typename OfStorage<DT>::E* p) { return of_widen<DT>(*p); }
template <int DT> __device__ __forceinline__ float of_load1_ro(const typename OfStorage<DT>::E* p) { return of_widen<DT>(__ldg(p)); }
template <int DT> __device__ __forceinline__ void of_store1(typename OfStorage<DT>::E* p, float v) { *p = of_narrow<DT>(v); }
template <int DT> __device__ __forceinline__ void of_store1_sr(typename OfStorage<DT>::E* p, float v, unsigned r) { *p = of_narrow_sr<DT>(v, r); }

// float64 math (a variant that computes in float64, variant_computes_f64): every role loaded as a
// double (float64 unchanged, the others widened exactly) and stored from one (float64 unrounded; the
// others rounded to float first, then as of_store1).
template <int DT> __device__ __forceinline__ double of_widen_d(typename OfStorage<DT>::E x) {
  if constexpr (DT == 4) return x;
  else return (double)of_widen<DT>(x);
}
template <int DT> __device__ __forceinline__ typename OfStorage<DT>::E of_narrow_d(double v) {
  if constexpr (DT == 4) return v;
  else return of_narrow<DT>((float)v);
}
template <int DT> __device__ __forceinline__ double of_load1d(const typename OfStorage<DT>::E* p) { return of_widen_d<DT>(*p); }
template <int DT> __device__ __forceinline__ double of_load1d_ro(const typename OfStorage<DT>::E* p) { return of_widen_d<DT>(__ldg(p)); }
template <int DT> __device__ __forceinline__ void of_store1d(typename OfStorage<DT>::E* p, double v) { *p = of_narrow_d<DT>(v); }
template <int DT> __device__ __forceinline__ void of_store1d_sr(typename OfStorage<DT>::E* p, double v, unsigned r) { *p = of_narrow_sr<DT>((float)v, r); }

// Vectors of a role: its elements held as 16-byte words (uint4), element e at byte e * size (one
// word holds 4 floats or 8 16-bit values; a variant mixing sizes moves 8 elements per vector, two
// words for a float32 role). Little-endian lanes.
__device__ __forceinline__ unsigned of_word(const uint4& w, int k) { return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w; }
__device__ __forceinline__ void of_set_word(uint4& w, int k, unsigned v) {
  if (k == 0) w.x = v; else if (k == 1) w.y = v; else if (k == 2) w.z = v; else w.w = v;
}
template <int DT> __device__ __forceinline__ float of_lane(const uint4* w, int e) {
  if constexpr (DT == 0) return __uint_as_float(of_word(w[e >> 2], e & 3));
  else return of_widen<DT>((unsigned short)(of_word(w[e >> 3], (e & 7) >> 1) >> (16 * (e & 1))));
}
template <int DT> __device__ __forceinline__ void of_set_bits(uint4* w, int e, unsigned bits) {
  uint4& word = w[e >> 3];
  const unsigned old = of_word(word, (e & 7) >> 1);
  of_set_word(word, (e & 7) >> 1, (e & 1) ? ((old & 0xffffu) | (bits << 16)) : ((old & 0xffff0000u) | bits));
}
template <int DT> __device__ __forceinline__ void of_set_lane(uint4* w, int e, float v) {
  if constexpr (DT == 0) of_set_word(w[e >> 2], e & 3, __float_as_uint(v));
  else of_set_bits<DT>(w, e, of_narrow<DT>(v));
}
template <int DT> __device__ __forceinline__ void of_set_lane_sr(uint4* w, int e, float v, unsigned r) {
  of_set_bits<DT>(w, e, of_narrow_sr<DT>(v, r));
}
// Lanes as doubles (float64 math): a float64 role holds 2 elements per word, element e at word e / 2.
template <int DT> __device__ __forceinline__ double of_lane_d(const uint4* w, int e) {
  if constexpr (DT == 4) {
    const uint4& word = w[e >> 1];
    return (e & 1) ? __hiloint2double((int)word.w, (int)word.z) : __hiloint2double((int)word.y, (int)word.x);
  } else {
    return (double)of_lane<DT>(w, e);
  }
}
template <int DT> __device__ __forceinline__ void of_set_lane_d(uint4* w, int e, double v) {
  if constexpr (DT == 4) {
    uint4& word = w[e >> 1];
    const unsigned lo = (unsigned)__double2loint(v), hi = (unsigned)__double2hiint(v);
    if (e & 1) { word.z = lo; word.w = hi; } else { word.x = lo; word.y = hi; }
  } else {
    of_set_lane<DT>(w, e, (float)v);
  }
}
template <int DT> __device__ __forceinline__ void of_set_lane_d_sr(uint4* w, int e, double v, unsigned r) {
  of_set_bits<DT>(w, e, of_narrow_sr<DT>((float)v, r));
}
// OF_CACHE_HINTS (a benchmark knob, default 0): 1 streams every 16-byte load and store through the
// caches as evict-first (ld/st.global.cs), 2 only the stores.
__device__ __forceinline__ uint4 of_load16(const void* p) {
#if OF_CACHE_HINTS == 1
  return __ldcs((const uint4*)p);
#else
  return *(const uint4*)p;
#endif
}
__device__ __forceinline__ uint4 of_load16_ro(const void* p) {
#if OF_CACHE_HINTS == 1
  return __ldcs((const uint4*)p);
#else
  return __ldg((const uint4*)p);
#endif
}
__device__ __forceinline__ void of_store16(void* p, const uint4& v) {
#if OF_CACHE_HINTS == 1 || OF_CACHE_HINTS == 2
  __stcs((uint4*)p, v);
#else
  *(uint4*)p = v;
#endif
}

// Sum over the block with a fixed shuffle tree (deterministic); the result is valid in thread 0.
// Every thread of the block must call it.
__device__ __forceinline__ double of_block_sum(double x, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < OF_THREADS / 32 ? scratch[lane] : 0.0;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  }
  __syncthreads();  // scratch may be reused by the next call
  return x;
}

// The largest value over the block with the same fixed tree (NaN-propagating: of_max); valid in thread 0.
__device__ __forceinline__ double of_block_max(double x, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = of_max(x, __shfl_down_sync(0xffffffffu, x, o));
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < OF_THREADS / 32 ? scratch[lane] : 0.0;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = of_max(x, __shfl_down_sync(0xffffffffu, x, o));
  }
  __syncthreads();
  return x;
}

// How partials fold: OF_SUM, OF_ANY (the OR of AnyNonFinite: partials are 0 or 1, summed then
// tested) or OF_MAX (MaxAbs: partials are >= 0 or NaN; 0 is the identity).
#define OF_SUM 0
#define OF_ANY 1
#define OF_MAX 2
__device__ __forceinline__ double of_fold(int kind, double acc, double v) { return kind == OF_MAX ? of_max(acc, v) : acc + v; }

// Combines one reduction's per-chunk partials in a fixed order: thread t takes chunks t, t + T,
// t + 2T, ... in order, then the block tree.
__device__ __forceinline__ double of_combine(const double* partials, long long num_chunks, int kind, double* scratch) {
  double s = 0.0;
  #pragma unroll 4
  for (long long c = threadIdx.x; c < num_chunks; c += OF_THREADS) s = of_fold(kind, s, partials[c]);
  s = kind == OF_MAX ? of_block_max(s, scratch) : of_block_sum(s, scratch);
  return kind == OF_ANY ? (s != 0.0 ? 1.0 : 0.0) : s;
}

// Where each tensor's chunks are among the partials' columns: the tensor table's own ranges, or,
// for a sharded step, each tensor's whole-tensor span in the global chunk order ([T][2] ints).
struct OfTableSpans {
  const OfTensor* t;
  __device__ int first(int i) const { return t[i].first_chunk; }
  __device__ int count(int i) const { return t[i].num_chunks; }
};
struct OfGlobalSpans {
  const int* s;
  __device__ int first(int i) const { return s[2 * i]; }
  __device__ int count(int i) const { return s[2 * i + 1]; }
};

// Combines one per-tensor reduction's partials: warp w takes tensors w, w + W, ... (W warps); in a
// tensor, lane l takes its chunks l, l + 32, ... in order, then a fixed shuffle tree. Deterministic.
template <class Spans>
__device__ __forceinline__ void of_combine_per_tensor(const double* partials, Spans spans, int num_tensors,
                                                      int kind, double* out, int stride) {
  const int lane = threadIdx.x & 31;
  for (int t = threadIdx.x >> 5; t < num_tensors; t += OF_THREADS / 32) {
    const int first = spans.first(t), count = spans.count(t);
    double s = 0.0;
    for (int c = lane; c < count; c += 32) s = of_fold(kind, s, partials[first + c]);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = of_fold(kind, s, __shfl_down_sync(0xffffffffu, s, o));
    if (lane == 0) out[(long long)t * stride] = kind == OF_ANY ? (s != 0.0 ? 1.0 : 0.0) : s;
  }
}
)";

// One group's uniform values for phase i, hyperparameters resolved from their sources.
// ustate_out: where the final phase commits the group's uniform states (the table's row in the
// last block; a scratch row in the prologue, where nothing may be committed).
std::string group_function(const Plan& plan, size_t i) {
  const bool ustates = plan.layout.uniform_states_per_group > 0;
  std::ostringstream s;
  s << "\n__device__ __forceinline__ void of_phase" << i
    << "_group(const double* table, int groups, int g, const OfHyperSource* sources, const double* globals, "
       "double* derived, double* skip, double* steps_out" << (ustates ? ", double* ustate_out" : "") << ") {\n"
    << "  double hyper[OF_HYPERS_ARRAY];\n"
    << "  const double* stored = table + of_hypers_offset() + (long long)g * OF_HYPERS;\n"
    << "  for (int k = 0; k < OF_HYPERS; ++k) {\n"
    << "    const OfHyperSource src = sources[(long long)g * OF_HYPERS + k];\n"
    << "    hyper[k] = src.ptr == 0ull ? stored[k] : src.type == 1 ? *(const double*)src.ptr : (double)*(const float*)src.ptr;\n"
    << "  }\n"
    << "  of_phase" << i << "_scalars(hyper, table[of_steps_offset(groups) + g], globals, table + of_reductions_offset(), "
       "derived, skip, steps_out"
    << (ustates ? ", table + of_ustate_offset(groups) + (long long)g * OF_USTATES, ustate_out" : "") << ");\n"
    << "}\n";
  return s.str();
}

bool writes_stochastically(const CudaPhaseRoles& pr, const StorageVariant& v) {
  for (int r : pr.writes)
    if (v[static_cast<size_t>(r)].stochastic) return true;
  return false;
}

// The chunk loop of a variant with q8 roles (optfuse/dtype.h): each warp takes whole blocks of
// OF_Q8_BLOCK elements (chunks start at multiples of it), each lane every 32nd element of the block.
// A q8 role is read as its code times the block's scale from before the step; its new values stay
// in registers until the block is done, then the warp folds their scale (a max: exact in any
// order) and encodes them. Lane 0 writes the scale after the shuffles, which every lane reaches
// only after reading the old one.
std::string q8_chunk_body(const CudaPhaseRoles& pr, const StorageVariant& var, const std::vector<std::string>& roles,
                          const std::string& element_fn, const std::string& T, const std::string& d) {
  auto nm = [&](int r) { return roles[static_cast<size_t>(r)]; };
  auto dt = [&](int r) { return static_cast<int>(var[static_cast<size_t>(r)].dtype); };
  auto q8 = [&](int r) { return var[static_cast<size_t>(r)].dtype == DType::q8; };
  auto type = [&](int r) {
    return q8(r) ? std::string("signed char") : dt(r) == 0 ? std::string("float") : dt(r) == 4 ? std::string("double") : std::string("unsigned short");
  };
  std::ostringstream s;
  s << "  (void)rng; (void)grad;\n"
    << "  const unsigned long long rng_first = (unsigned long long)(t.rng_offset + begin);  // the chunk's first element in the tensor\n"
    << "  (void)rng_first;\n";
  for (int r : pr.used) {
    s << "  " << type(r) << "* __restrict__ " << nm(r) << "_p = (" << type(r) << "*)"
      << (r == 1 ? std::string("grad") : "t.ptr[" + std::to_string(r) + "]") << " + begin;\n";
    if (q8(r))
      s << "  float* __restrict__ " << nm(r) << "_s = (float*)((char*)t.ptr[" << r
        << "] + of_q8_scales_offset(t.numel)) + begin / OF_Q8_BLOCK;\n";
  }
  s << "  const int lane = threadIdx.x & 31;\n"
    << "  for (int b0 = (threadIdx.x >> 5) * OF_Q8_BLOCK; b0 < len; b0 += (OF_THREADS / 32) * OF_Q8_BLOCK) {\n"
    << "    const int bn = len - b0 < OF_Q8_BLOCK ? len - b0 : OF_Q8_BLOCK;\n";
  for (int r : pr.reads)
    if (q8(r)) s << "    const float " << nm(r) << "_os = " << nm(r) << "_s[b0 / OF_Q8_BLOCK];\n";
  for (int r : pr.writes)
    if (q8(r)) s << "    " << T << " " << nm(r) << "_nv[OF_Q8_BLOCK / 32];\n";
  s << "    #pragma unroll\n    for (int k = 0; k < OF_Q8_BLOCK / 32; ++k) {\n"
    << "      const int j = lane + 32 * k;\n";
  for (int r : pr.writes)
    if (q8(r)) s << "      " << nm(r) << "_nv[k] = 0;\n";
  s << "      if (j < bn) {\n        const int e = b0 + j;\n        " << T << " v[OF_ROLES];\n";
  for (int r : pr.reads) {
    if (q8(r))
      s << "        v[" << r << "] = (" << T << ")of_q8_decode(" << nm(r) << "_p[e], " << nm(r) << "_os);\n";
    else
      s << "        v[" << r << "] = of_load1" << d << (pr.read_only(r) ? "_ro" : "") << "<" << dt(r) << ">(" << nm(r) << "_p + e);\n";
  }
  s << "        " << element_fn << "(v, u, acc);\n";
  for (int r : pr.writes) {
    if (q8(r))
      s << "        " << nm(r) << "_nv[k] = v[" << r << "];\n";
    else if (var[static_cast<size_t>(r)].stochastic)
      s << "        of_store1" << d << "_sr<" << dt(r) << ">(" << nm(r) << "_p + e, v[" << r << "], of_rng_bits(rng, rng_first + (unsigned long long)e, " << r << "));\n";
    else
      s << "        of_store1" << d << "<" << dt(r) << ">(" << nm(r) << "_p + e, v[" << r << "]);\n";
  }
  s << "      }\n    }\n";
  for (int r : pr.writes) {
    if (!q8(r)) continue;
    const std::string n = nm(r);
    s << "    {\n      float scale = 0.0f;\n"
      << "      #pragma unroll\n      for (int k = 0; k < OF_Q8_BLOCK / 32; ++k) scale = of_q8_fold_scale(scale, (float)" << n << "_nv[k]);\n"
      << "      for (int o = 16; o > 0; o >>= 1) scale = fmaxf(scale, __shfl_xor_sync(0xffffffffu, scale, o));\n"
      << "      if (lane == 0) " << n << "_s[b0 / OF_Q8_BLOCK] = scale;\n"
      << "      #pragma unroll\n      for (int k = 0; k < OF_Q8_BLOCK / 32; ++k)\n"
      << "        if (lane + 32 * k < bn) " << n << "_p[b0 + lane + 32 * k] = (signed char)of_q8_encode((float)" << n << "_nv[k], scale);\n"
      << "    }\n";
  }
  s << "  }\n}\n";
  return s.str();
}

// Phase i's loop over one chunk of one tensor of storage variant k (concrete types per role).
std::string chunk_function(const Plan& plan, size_t i, size_t k, const StorageVariant& var) {
  const bool ahead = variant_runs_states_ahead(plan, var);
  const ElementPhase& ph = plan.phase_for(i, ahead);  // (the recomputing form for 16-bit states written ahead)
  // float64 math where the variant has a float64 role: double values, u and loads/stores (the _d forms).
  const bool f64 = variant_computes_f64(var);
  const std::string T = f64 ? "double" : "float", d = f64 ? "d" : "", _d = f64 ? "_d" : "";
  const std::string element_fn = element_function_name(plan, i, ahead, f64);
  CudaPhaseRoles pr = cuda_phase_roles(ph);
  std::vector<std::string> roles = role_names(plan);
  auto nm = [&](int r) { return roles[static_cast<size_t>(r)]; };
  auto dt = [&](int r) { return static_cast<int>(var[static_cast<size_t>(r)].dtype); };
  auto size = [&](int r) { return static_cast<int>(dtype_size(var[static_cast<size_t>(r)].dtype)); };
  auto type = [&](int r) {
    return dt(r) == 0 ? std::string("float") : dt(r) == 4 ? std::string("double") : std::string("unsigned short");
  };
  size_t nred = std::max<size_t>(ph.reductions.size(), 1);
  std::ostringstream s;
  s << "\n// phase " << i << ", variant " << k << ": " << describe_variant(var, roles) << "\n"
    << "__device__ __forceinline__ void of_phase" << i << "_v" << k
    << "_chunk(const OfTensor& t, void* grad, long long begin, int len, const " << T
    << "* u, double* acc, unsigned long long rng) {\n";
  if (pr.used.empty()) {  // a phase that touches no tensor memory (every output folded to a constant)
    s << "  (void)t; (void)grad; (void)begin; (void)len; (void)u; (void)acc; (void)rng;\n}\n";
    return s.str();
  }
  if (variant_has_q8(var)) {
    s << q8_chunk_body(pr, var, roles, element_fn, T, d);
    return s.str();
  }
  int narrow = pr.used[0];
  bool all32 = true;  // (or wider: a float64 role moves 2 elements per vector)
  for (int r : pr.used) {
    if (size(r) < size(narrow)) narrow = r;
    all32 = all32 && size(r) >= 4;
  }
  const int vec = 16 / size(narrow);  // elements per vector
  s << "  constexpr int kVec = " << vec << ";   // elements per vector (16 bytes of the narrowest role)\n"
    << "  constexpr int kUnroll = " << (all32 ? "OF_UNROLL_32" : "OF_UNROLL_16") << ";  // vectors per role per thread per pass\n"
    << "  (void)rng;\n"
    // In a register: t is in global memory, and its fields could be reloaded after every store.
    << "  const unsigned long long rng_first = (unsigned long long)(t.rng_offset + begin);  // the chunk's first element in the tensor\n"
    << "  (void)rng_first;\n";
  s << "  (void)grad;\n";
  // The gradient's pointer comes from the table's tail (tensor_table.h), the others from t.
  for (int r : pr.used)
    s << "  " << type(r) << "* __restrict__ " << nm(r) << "_p = (" << type(r) << "*)"
      << (r == 1 ? std::string("grad") : "t.ptr[" + std::to_string(r) + "]") << " + begin;\n";
  // The vector path needs a head (elements before it) after which every role is 16-byte aligned.
  s << "  int head = (int)(((16u - (unsigned)((unsigned long long)" << nm(narrow) << "_p & 15u)) & 15u) / " << size(narrow)
    << "u);\n  const bool aligned = ((unsigned long long)" << nm(narrow) << "_p % " << size(narrow) << "u) == 0";
  for (int r : pr.used)
    if (r != narrow) s << "\n      && (((unsigned long long)" << nm(r) << "_p + (unsigned long long)head * " << size(r) << "u) & 15u) == 0";
  s << ";\n  int nvec = 0;\n"
    << "  if (aligned) {\n    if (head > len) head = len;\n    nvec = (len - head) / kVec;\n  } else {\n    head = 0;\n  }\n"
    << "  const int body_end = head + nvec * kVec, scalar_count = head + (len - body_end);\n";
  auto store1 = [&](int r, const std::string& idx) {
    std::ostringstream o;
    if (var[static_cast<size_t>(r)].stochastic)
      o << "of_store1" << d << "_sr<" << dt(r) << ">(" << nm(r) << "_p + " << idx << ", v[" << r << "], of_rng_bits(rng, rng_first + (unsigned long long)(" << idx << "), " << r
        << "))";
    else
      o << "of_store1" << d << "<" << dt(r) << ">(" << nm(r) << "_p + " << idx << ", v[" << r << "])";
    return o.str();
  };
  // Scalar path: the head before the first 16-byte boundary, then the tail after the last vector.
  s << "  for (int j = threadIdx.x; j < scalar_count; j += OF_THREADS) {\n"
    << "    const int e = j < head ? j : body_end + (j - head);\n"
    << "    " << T << " v[OF_ROLES];\n";
  for (int r : pr.reads)
    s << "    v[" << r << "] = of_load1" << d << (pr.read_only(r) ? "_ro" : "") << "<" << dt(r) << ">(" << nm(r) << "_p + e);\n";
  s << "    " << element_fn << "(v, u, acc);\n";
  for (int r : pr.writes) s << "    " << store1(r, "e") << ";\n";
  s << "  }\n";
  // Vector body: all loads of a pass first (memory-level parallelism), then math and stores.
  auto words = [&](int r) { return vec * size(r) / 16; };
  s << "  double acc_u[kUnroll][" << nred << "];\n"
    << "  #pragma unroll\n  for (int k = 0; k < kUnroll; ++k)\n"
    << "    for (int r = 0; r < " << nred << "; ++r) acc_u[k][r] = 0.0;\n"
    << "  for (int base = threadIdx.x; base < nvec; base += kUnroll * OF_THREADS) {\n";
  for (int r : pr.reads) s << "    uint4 " << nm(r) << "_in[kUnroll][" << words(r) << "];\n";
  s << "    #pragma unroll\n    for (int k = 0; k < kUnroll; ++k) {\n"
    << "      const int vi = base + k * OF_THREADS;\n"
    << "      if (vi < nvec) {\n";
  for (int r : pr.reads)
    for (int w = 0; w < words(r); ++w)
      s << "        " << nm(r) << "_in[k][" << w << "] = of_load16" << (pr.read_only(r) ? "_ro" : "") << "(" << nm(r)
        << "_p + head + (long long)vi * kVec + " << w * 16 / size(r) << ");\n";
  s << "      }\n    }\n"
    << "    #pragma unroll\n    for (int k = 0; k < kUnroll; ++k) {\n"
    << "      const int vi = base + k * OF_THREADS;\n"
    << "      if (vi < nvec) {\n";
  for (int r : pr.writes) s << "        uint4 " << nm(r) << "_out[" << words(r) << "];\n";
  s << "        #pragma unroll\n        for (int e = 0; e < kVec; ++e) {\n"
    << "          " << T << " v[OF_ROLES];\n";
  for (int r : pr.reads) s << "          v[" << r << "] = of_lane" << _d << "<" << dt(r) << ">(" << nm(r) << "_in[k], e);\n";
  s << "          " << element_fn << "(v, u, acc_u[k]);\n";
  for (int r : pr.writes) {
    if (var[static_cast<size_t>(r)].stochastic)
      s << "          of_set_lane" << _d << "_sr<" << dt(r) << ">(" << nm(r) << "_out, e, v[" << r
        << "], of_rng_bits(rng, rng_first + (unsigned long long)(head + vi * kVec + e), " << r << "));\n";
    else
      s << "          of_set_lane" << _d << "<" << dt(r) << ">(" << nm(r) << "_out, e, v[" << r << "]);\n";
  }
  s << "        }\n";
  for (int r : pr.writes)
    for (int w = 0; w < words(r); ++w)
      s << "        of_store16(" << nm(r) << "_p + head + (long long)vi * kVec + " << w * 16 / size(r) << ", " << nm(r) << "_out[" << w
        << "]);\n";
  s << "      }\n    }\n  }\n";
  // Fixed-order merge of the unrolled slots' accumulators.
  if (ph.kind == ElementPhase::Kind::Reduce) {
    s << "  #pragma unroll\n  for (int k = 0; k < kUnroll; ++k) {\n";
    for (size_t r = 0; r < ph.reductions.size(); ++r) {  // (a max of abs folds by of_max: its slots hold maxima)
      const bool max = plan.program.graph.node(ph.reductions[r]).op == Op::MaxAbs;
      s << "    acc[" << r << "] = " << (max ? "of_max(" : "(") << "acc[" << r << "]" << (max ? ", " : " + ") << "acc_u[k][" << r
        << "]);\n";
    }
    s << "  }\n";
  }
  s << "  (void)acc_u; (void)acc;\n}\n";
  return s.str();
}

// OF_SUM, OF_ANY or OF_MAX: how a reduction's partials fold (the driver prelude).
const char* fold_kind(Op op) { return op == Op::AnyNonFinite ? "OF_ANY" : op == Op::MaxAbs ? "OF_MAX" : "OF_SUM"; }

// The Combine step of reduce phase i, for one block: each reduction's partials (rows of `cols`
// columns) in a fixed order into the table (global scope) or tensor_reductions (per tensor; where
// each tensor's chunks are: `spans`).
std::string combine_code(const Plan& plan, size_t i, const std::string& cols, const std::string& spans) {
  const ElementPhase& ph = plan.phases[i];
  const Graph& g = plan.program.graph;
  std::ostringstream s;
  for (NodeId node : ph.reductions) {
    size_t r = plan.reduction_index(node);
    const char* kind = fold_kind(g.node(node).op);
    int slot = plan.reduction_area_slot[r];
    if (plan.scope_of(r) == Scope::Row || plan.scope_of(r) == Scope::Col) continue;  // matrix tables (the Values step)
    if (plan.scope_of(r) == Scope::Global)
      s << "  {\n    const double total = of_combine(partials + " << r << "LL * " << cols << ", " << cols << ", "
        << kind << ", scratch);\n"
        << "    if (threadIdx.x == 0) table[" << plan.layout.reductions_offset() + slot << "] = total;\n  }\n";
    else
      s << "  of_combine_per_tensor(partials + " << r << "LL * " << cols << ", " << spans << ", num_tensors, "
        << kind << ", tensor_reductions + " << slot << ", OF_TENSOR_REDUCTIONS);\n";
  }
  return s.str();
}

std::string element_kernel(const Plan& plan, size_t i, const std::vector<StorageVariant>& variants) {
  const ElementPhase& ph = plan.phases[i];
  const Graph& g = plan.program.graph;
  bool update = ph.kind == ElementPhase::Kind::Update;
  const bool ustates = plan.layout.uniform_states_per_group > 0;
  size_t nred = ph.reductions.size();
  const bool matrix = plan.matrix();
  bool row_reds = false;
  for (NodeId r : ph.reductions) row_reds = row_reds || reduction_scope(g.node(r)) == Scope::Row;
  bool stochastic = false;
  for (const StorageVariant& v : variants)
    stochastic = stochastic || writes_stochastically(cuda_phase_roles(plan.phase_for(i, variant_runs_states_ahead(plan, v))), v);
  std::ostringstream s;
  s << "\nextern \"C\" __global__ void __launch_bounds__(OF_THREADS, "
    << (stochastic ? "OF_MIN_BLOCKS_SR" : "OF_MIN_BLOCKS") << ") of_phase" << i
    << "(const OfTensor* __restrict__ tensors, const OfChunk* __restrict__ chunks, long long num_chunks,"
       " double* __restrict__ table, int groups, double* __restrict__ partials,"
       " double* __restrict__ tensor_reductions, int num_tensors,"
       " const OfHyperSource* __restrict__ sources, const float* grad_scale, const float* found_inf,"
       " unsigned* done_count, int combine_here" << (matrix ? ", OfMatrixTables mt" : "") << ") {\n"
    << "  extern __shared__ double of_uniform[];  // [groups][OF_UNIFORM]\n"
    << "  __shared__ double globals[2];\n"
    << "  __shared__ double scratch[OF_THREADS / 32];\n"
    << "  __shared__ int last_block;\n"
    << (matrix && row_reds ? "  __shared__ double of_srow[OF_ROW_REDS_ARRAY * OF_MROWS * (OF_THREADS / 32)], of_racc[OF_ROW_REDS_ARRAY * OF_MROWS];\n"
                           : matrix ? "  double* const of_srow = nullptr;\n  double* const of_racc = nullptr;\n" : "")
    << cuda_uniform_prologue(plan, i)
    << "  if ((long long)blockIdx.x < num_chunks) {\n"
    << "  OfChunk ch = chunks[blockIdx.x];\n"
    << "#if OF_DYNAMIC_CHUNKS\n"
    << "  __shared__ long long of_next_chunk;\n"
    << "  for (long long c = blockIdx.x; c < num_chunks;) {\n"
    << "    // The next chunk is taken while this one runs (read after the chunk's work).\n"
    << "    if (threadIdx.x == 0) of_next_chunk = (long long)gridDim.x + atomicAdd(done_count + 1, 1u);\n"
    << "#else\n"
    << "  for (long long c = blockIdx.x; c < num_chunks; c += gridDim.x) {\n"
    << "    // The next chunk's descriptor is fetched while this one runs.\n"
    << "    const OfChunk next = c + gridDim.x < num_chunks ? chunks[c + gridDim.x] : ch;\n"
    << "#endif\n"
    << "    const OfTensor& t = tensors[ch.tensor];\n"
    << "    void* const grad = ((void* const*)(tensors + num_tensors))[ch.tensor];  // the table's gradient tail\n"
    << "    const double* uni = of_uniform + (long long)t.group * OF_UNIFORM;\n"
    << (update ? "    if (uni[OF_DERIVED] == 0.0) {  // uniform over the block: a skipped group's chunks are passed over\n"
               : "    {\n");
  s << "    float u[OF_VALUES_ARRAY];  // uniform inputs, rounded to float as they enter element math\n"
    << "    #pragma unroll\n    for (int d = 0; d < OF_DERIVED; ++d) u[d] = (float)uni[d];\n";
  if (matrix)
    s << "    const OfMatrix m = mt.m[ch.tensor];\n    double shape[4];\n    of_shape(t, m, shape);\n";
  if (plan.layout.tensor_values > 0)
    s << "    of_phase" << i << "_tensor(uni, tensor_reductions + (long long)ch.tensor * OF_TENSOR_REDUCTIONS, "
      << (matrix ? "mt.matrix_sums + (m.matrix_offset + ch.begin / m.cols / m.matrix_rows) * OF_TENSOR_REDUCTIONS, shape, " : "")
      << "u + OF_DERIVED);\n";
  const bool any_f64 = any_variant_computes_f64(variants);
  if (any_f64) {  // float64 math's inputs, unrounded (computed for every tensor: a few double copies)
    s << "    double ud[OF_VALUES_ARRAY];  // uniform inputs of float64 math (variants with a float64 role)\n"
      << "    #pragma unroll\n    for (int d = 0; d < OF_DERIVED; ++d) ud[d] = uni[d];\n";
    if (plan.layout.tensor_values > 0)
      s << "    of_phase" << i << "_tensor_f64(uni, tensor_reductions + (long long)ch.tensor * OF_TENSOR_REDUCTIONS, ud + OF_DERIVED);\n";
  }
  s
    << "    double acc[" << std::max<size_t>(nred, 1) << "] = {0.0};\n";
  if (stochastic)  // the step being taken: the table's count is committed by the last block, after every chunk
    s << "    const unsigned long long rng = of_rng_base(t.rng_key, (unsigned long long)(table[of_steps_offset(groups) + t.group] + 1.0));\n";
  else
    s << "    const unsigned long long rng = 0;\n";
  s << "    switch (t.variant) {\n";
  // A matrix plan: the matrix chunk loop (cuda_matrix_source.h); the update pass then commits Rows
  // and Cols states.
  for (size_t k = 0; k < variants.size(); ++k)
    if (matrix)
      s << "      case " << k << ": of_phase" << i << "_v" << k
        << "_mchunk(t, m, grad, ch.begin, ch.length, u, acc, rng, c - t.first_chunk, mt, of_srow, of_racc, scratch, uni, "
           "tensor_reductions + (long long)ch.tensor * OF_TENSOR_REDUCTIONS, shape);"
        << (update ? " of_phase" + std::to_string(i) + "_v" + std::to_string(k) + "_commit(t, m, ch.begin, ch.length, c - t.first_chunk, mt);" : "")
        << " break;\n";
    else
      s << "      case " << k << ": of_phase" << i << "_v" << k << "_chunk(t, grad, ch.begin, ch.length, "
        << (variant_computes_f64(variants[k]) ? "ud" : "u") << ", acc, rng); break;\n";
  s << "      default: break;  // every tensor's variant is compiled (the executor guarantees it)\n    }\n";
  for (size_t k = 0; k < nred; ++k) {
    const Op op = g.node(ph.reductions[k]).op;
    const bool any = op == Op::AnyNonFinite;
    const Scope scope = reduction_scope(g.node(ph.reductions[k]));
    if (scope == Scope::Row || scope == Scope::Col) continue;  // written by the matrix chunk loop itself
    s << "    {\n      const double total = " << (op == Op::MaxAbs ? "of_block_max" : "of_block_sum") << "(acc[" << k
      << "], scratch);\n"
      << "      if (threadIdx.x == 0) partials[" << plan.reduction_index(ph.reductions[k]) << "LL * num_chunks + c] = "
      << (any ? "total != 0.0 ? 1.0 : 0.0" : "total") << ";\n    }\n";
  }
  s << "    }\n"
    << "#if OF_DYNAMIC_CHUNKS\n"
    << "    __syncthreads();  // of_next_chunk written\n"
    << "    c = of_next_chunk;\n"
    << "    __syncthreads();  // and read by every thread before thread 0 takes another\n"
    << "    if (c < num_chunks) ch = chunks[c];\n"
    << "#else\n"
    << "    ch = next;\n"
    << "#endif\n"
    << "  }\n  }\n";
  // The last block: every other block has finished (their partials are visible after the fence).
  s << "  __syncthreads();\n"
    << "  if (threadIdx.x == 0) {\n"
    << "    __threadfence();\n"
    << "    last_block = atomicAdd(done_count, 1u) == gridDim.x - 1;\n  }\n"
    << "  __syncthreads();\n"
    << "  if (!last_block) return;\n"
    << "  __threadfence();\n";
  if (nred > 0) s << "  if (combine_here) {  // else a sharded step combines every rank's partials (of_combine" << i << ")\n"
                  << combine_code(plan, i, "num_chunks", "OfTableSpans{tensors}") << "  }\n";
  if (update)
    s << "  if (threadIdx.x == 0) { table[0] = globals[0]; table[1] = globals[1]; }\n"
      << "  const long long steps_at = of_steps_offset(groups), derived_at = of_derived_offset(groups);\n"
      << "  for (int g = threadIdx.x; g < groups; g += OF_THREADS)  // commit: skip, derived values, step count"
      << (ustates ? ", uniform states" : "") << "\n"
      << "    of_phase" << i << "_group(table, groups, g, sources, globals, table + derived_at + (long long)g * OF_DERIVED, "
      << "table + of_skip_offset(groups) + g, table + steps_at + g"
      << (ustates ? ", table + of_ustate_offset(groups) + (long long)g * OF_USTATES" : "") << ");\n";
  s << "  if (threadIdx.x == 0) { done_count[0] = 0u; done_count[1] = 0u; }  // ready for the next launch (or graph replay)\n"
    << "  (void)partials; (void)scratch; (void)tensor_reductions; (void)num_tensors; (void)combine_here;\n}\n";
  if (nred > 0)  // the Combine step of a sharded step: one block over every rank's partials
    s << "\nextern \"C\" __global__ void __launch_bounds__(OF_THREADS) of_combine" << i
      << "(const double* __restrict__ partials, long long num_chunks, const int* __restrict__ spans, int num_tensors,"
         " double* __restrict__ table, double* __restrict__ tensor_reductions) {\n"
      << "  __shared__ double scratch[OF_THREADS / 32];\n"
      << combine_code(plan, i, "num_chunks", "OfGlobalSpans{spans}") << "}\n";
  return s.str();
}

}  // namespace

std::string cuda_uniform_prologue(const Plan& plan, size_t i) {
  const bool ustates = plan.layout.uniform_states_per_group > 0;
  std::ostringstream s;
  s << "  if (threadIdx.x == 0) {  // the step's globals, read on the device: no host synchronisation\n"
    << "    globals[0] = grad_scale ? (double)*grad_scale : 1.0;\n"
    << "    globals[1] = found_inf ? (double)*found_inf : 0.0;\n  }\n"
    << "  __syncthreads();\n"
    << "  for (int g = threadIdx.x; g < groups; g += OF_THREADS) {\n"
    << "    double steps_unused;\n"
    << (ustates ? "    double ustate_unused[OF_USTATES];  // the commit is the last block's, after every block read the old values\n" : "")
    << "    double* mine = of_uniform + (long long)g * OF_UNIFORM;\n"
    << "    of_phase" << i << "_group(table, groups, g, sources, globals, mine, mine + OF_DERIVED, &steps_unused"
    << (ustates ? ", ustate_unused" : "") << ");\n"
    << "  }\n"
    << "  __syncthreads();\n";
  return s.str();
}

std::string generate_cuda_source(const Plan& plan) { return generate_cuda_source(plan, default_variants(plan)); }

std::string generate_cuda_source(const Plan& plan, const std::vector<StorageVariant>& variants) {
  // Matrix plans keep their row and column value tables in float32 on the device: float64 tensors
  // step there on the reference and CPU backends (docs/architecture.md, Low precision).
  if (plan.matrix() && any_variant_computes_f64(variants))
    throw Error("the CUDA backend does not step float64 tensors with a chain of row or column values (" +
                plan.program.chain_text + ") yet; use the cpu backend, or float32 storage");
  CPrinter pr(plan, cuda_dialect());
  std::ostringstream s;
  // Kernel shape, measured on an H200 (dev/h200_cuda_check.sh --tune): one 16-byte vector per role
  // per thread per pass with at least 3 blocks of 256 threads per SM (an 85-register cap, no spills
  // for any built-in) reached the copy bandwidth on large tensors; deeper unrolling with fewer
  // blocks, or 4-6 blocks, was up to 5% slower. A kernel that rounds stochastically is bound by its
  // integer work and memory latency instead: 4 blocks (64 registers) ran AdamW bf16 with stochastic
  // rounding at 89.1% of its floor against 85.7% with 3 (H200, docs/performance.md), while the other
  // bf16/fp32 kernels were 1-4 points slower with 4. The #ifndef lets a benchmark override them
  // (OPTFUSE_CUDA_DEFINES in the executor).
  s << pr.header_comment() << "#define OF_ROLES " << pr.num_roles() << "\n#define OF_THREADS " << kThreads << "\n#ifndef OF_UNROLL_32\n#define OF_UNROLL_32 1\n#endif\n#ifndef OF_UNROLL_16\n#define OF_UNROLL_16 1\n#endif\n"
    << "#ifndef OF_MIN_BLOCKS\n#define OF_MIN_BLOCKS 3\n#endif\n"
    << "#ifndef OF_MIN_BLOCKS_SR\n#define OF_MIN_BLOCKS_SR 4\n#endif\n"
    << "#ifndef OF_CACHE_HINTS\n#define OF_CACHE_HINTS 0\n#endif\n"
    // 1: a block takes its next chunk from a device counter when it starts one (an atomic per
    // chunk), not blockIdx.x + k * gridDim.x: no block sits idle while another has chunks left.
    // Each chunk's partials keep their slot, so the sums are the same either way. On the H200 it
    // took AdamW on gpt2-small from 93.6% to 97.4% of its floor and Adafactor's passes on
    // moe-experts from 88.8/83.8/87.3% to 90.2/87.8/91.9% (docs/performance.md).
    << "#ifndef OF_DYNAMIC_CHUNKS\n#define OF_DYNAMIC_CHUNKS 1\n#endif\n"
    << pr.common_source(any_variant_computes_f64(variants)) << abi_source() << layout_source(plan) << kCudaDriverPrelude;
  if (plan.matrix()) s << cuda_matrix_prelude();
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    s << group_function(plan, i);
    for (size_t k = 0; k < variants.size(); ++k) {
      if (!plan.matrix()) s << chunk_function(plan, i, k, variants[k]);
      else s << cuda_matrix_chunk_function(plan, i, k, variants[k]);
      if (plan.matrix() && plan.phases[i].kind == ElementPhase::Kind::Update) s << cuda_matrix_commit_function(plan, i, k, variants[k]);
    }
    s << element_kernel(plan, i, variants);
    if (plan.matrix()) s << cuda_values_kernel(plan, i, variants);
  }
  return s.str();
}

int cuda_block_threads() { return kThreads; }

int cuda_pass_counters() { return 2; }

size_t cuda_uniform_shared_bytes(const Plan& plan, int groups) {
  return static_cast<size_t>(groups) * static_cast<size_t>(plan.layout.derived_per_group + 1) * sizeof(double);
}

std::vector<std::string> cuda_kernel_names(const Plan& plan) {
  std::vector<std::string> names;
  for (size_t i = 0; i < plan.phases.size(); ++i) names.push_back("of_phase" + std::to_string(i));
  for (size_t i = 0; plan.matrix() && i < plan.phases.size(); ++i) names.push_back("of_values" + std::to_string(i));
  return names;
}

}  // namespace optfuse
