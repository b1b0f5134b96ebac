// The CUDA matrix phase: four small kernels of our own (the Frobenius norms, the scaled bf16 copy,
// the store back) around cuBLAS strided-batched bf16 GEMMs, all queued on the caller's stream.
//
// Layout: the bf16 work matrix Y has M's row-major layout. Read column-major (cuBLAS's view), a
// row-major rows x cols matrix is its cols x rows transpose, so
//   wide (rows <= cols, X = M):   Y is X^T, l x s, ld l:  A = Y^T Y;  X' = a X + B X  is  Y' = a Y + Y B^T
//   tall (rows > cols, X = M^T):  Y is X,   s x l, ld s:  A = Y Y^T;  Y' = a Y + B Y
// and no transposition is ever copied. cuBLAS reads C and writes it (beta C + alpha op(A) op(B)), so
// B starts as a copy of A and Y' as a copy of Y (device-to-device copies, small next to the products).
#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "codegen/c_printer.h"
#include "matrix/gemm_libraries.h"
#include "matrix/newton_schulz_impl.h"
#include "optfuse/error.h"
#include "runtime/cuda_api.h"

namespace optfuse {

namespace {

constexpr int kThreads = 256;
constexpr long long kChunk = 65536;  // elements of one matrix per block of the norm and scale kernels

// (OF_NS_THREADS and OF_NS_CHUNK are printed before this from kThreads and kChunk.)
const char* kKernels = R"(
// Storage dtype codes as DType: 0 float32, 1 float16, 2 bfloat16.
__device__ __forceinline__ float of_ns_load(const void* m, int dtype, long long i) {
  if (dtype == 0) return ((const float*)m)[i];
  unsigned short h = ((const unsigned short*)m)[i];
  return dtype == 2 ? of_bf16_to_float(h) : of_f16_to_float(h);
}
__device__ __forceinline__ double of_ns_block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int w = OF_NS_THREADS / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  return red[0];
}
// Block b sums the squares of bf16(M) over chunk b % chunks of matrix b / chunks: a fixed
// assignment and tree, so the norms are the same bits on every run.
extern "C" __global__ void __launch_bounds__(OF_NS_THREADS) of_ns_partials(const void* m, int dtype, long long per, int chunks,
                                                           double* partials) {
  __shared__ double red[OF_NS_THREADS];
  const long long matrix = blockIdx.x / chunks, begin = (blockIdx.x % chunks) * OF_NS_CHUNK;
  const long long end = begin + OF_NS_CHUNK < per ? begin + OF_NS_CHUNK : per;
  float acc = 0.0f;
  for (long long i = begin + threadIdx.x; i < end; i += OF_NS_THREADS) {
    const float v = of_round_bf16(of_ns_load(m, dtype, matrix * per + i));
    acc += v * v;
  }
  const double s = of_ns_block_sum((double)acc, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
// Block b: the norm of matrix b as torch.optim.Muon has it, max(bf16(||X||), eps) in bf16.
extern "C" __global__ void __launch_bounds__(OF_NS_THREADS) of_ns_norms(const double* partials, int chunks, float eps,
                                                        float* norms) {
  __shared__ double red[OF_NS_THREADS];
  double s = 0.0;
  for (int c = threadIdx.x; c < chunks; c += OF_NS_THREADS) s += partials[(long long)blockIdx.x * chunks + c];
  s = of_ns_block_sum(s, red);
  if (threadIdx.x == 0) norms[blockIdx.x] = of_round_bf16(of_max(of_round_bf16((float)sqrt(s)), eps));
}
// Y = bf16(bf16(M) / norm), chunk by chunk as of_ns_partials.
extern "C" __global__ void __launch_bounds__(OF_NS_THREADS) of_ns_scale(const void* m, int dtype, long long per, int chunks,
                                                        const float* norms, unsigned short* y) {
  const long long matrix = blockIdx.x / chunks, begin = (blockIdx.x % chunks) * OF_NS_CHUNK;
  const long long end = begin + OF_NS_CHUNK < per ? begin + OF_NS_CHUNK : per;
  const float n = norms[matrix];
  for (long long i = begin + threadIdx.x; i < end; i += OF_NS_THREADS) {
    const long long k = matrix * per + i;
    y[k] = of_float_to_bf16(of_round_bf16(of_ns_load(m, dtype, k)) / n);
  }
}
// M = Y in M's dtype (exact for float32 and bfloat16).
extern "C" __global__ void __launch_bounds__(OF_NS_THREADS) of_ns_store(const unsigned short* y, int dtype, long long n,
                                                        void* m) {
  for (long long i = blockIdx.x * (long long)OF_NS_THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * OF_NS_THREADS) {
    if (dtype == 0) ((float*)m)[i] = of_bf16_to_float(y[i]);
    else if (dtype == 2) ((unsigned short*)m)[i] = y[i];
    else ((unsigned short*)m)[i] = of_float_to_f16(of_bf16_to_float(y[i]));
  }
}
)";

struct Kernels {
  std::shared_ptr<const cuda::Module> module;
  CUfunction partials, norms, scale, store;
};

// Compiled and loaded once per architecture for the process (a map: references stay valid).
const Kernels& kernels_for(int arch) {
  static std::mutex mu;
  static std::map<int, Kernels> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded.find(arch); it != loaded.end()) return it->second;
  Kernels k;
  k.module = cuda::shared_module(cuda::compile(newton_schulz_cuda_source(), "optfuse_newton_schulz", arch).cubin);
  k.partials = k.module->function("of_ns_partials");
  k.norms = k.module->function("of_ns_norms");
  k.scale = k.module->function("of_ns_scale");
  k.store = k.module->function("of_ns_store");
  return loaded.emplace(arch, k).first->second;
}

class CudaNewtonSchulz final : public NewtonSchulz::Impl {
 public:
  CudaNewtonSchulz(MatrixBatchShape s, NewtonSchulzOptions o)
      : Impl(s, o), device_(cuda::current_device()), kernels_(&kernels_for(device_.arch())) {}

  void run(void* data, void* stream_ptr) override {
    CUstream stream = static_cast<CUstream>(stream_ptr);
    const long long s = short_side(), l = long_side(), per = s * l, batch = shape.batch;
    int chunks = static_cast<int>((per + kChunk - 1) / kChunk);
    if (!made_ || stream != made_on_) allocate(stream, per, chunks);
    CUdeviceptr m = reinterpret_cast<CUdeviceptr>(data);
    int dtype = static_cast<int>(shape.dtype);
    long long per_arg = per;
    {
      CUdeviceptr partials = partials_.ptr();
      void* args[] = {&m, &dtype, &per_arg, &chunks, &partials};
      cuda::launch(kernels_->partials, static_cast<unsigned>(batch * chunks), kThreads, 0, stream, args);
    }
    {
      CUdeviceptr partials = partials_.ptr(), norms = norms_.ptr();
      float eps = static_cast<float>(options.eps);
      void* args[] = {&partials, &chunks, &eps, &norms};
      cuda::launch(kernels_->norms, static_cast<unsigned>(batch), kThreads, 0, stream, args);
    }
    CUdeviceptr y = y_.ptr(), next = next_.ptr();
    {
      CUdeviceptr norms = norms_.ptr();
      void* args[] = {&m, &dtype, &per_arg, &chunks, &norms, &y};
      cuda::launch(kernels_->scale, static_cast<unsigned>(batch * chunks), kThreads, 0, stream, args);
    }
    const auto [ca, cb, cc] = options.coefficients;
    const int S = static_cast<int>(s), Lg = static_cast<int>(l), B = static_cast<int>(batch);
    const CUdeviceptr a = a_.ptr(), b = b_.ptr();
    const size_t gram_bytes = static_cast<size_t>(batch * s * s) * 2, y_bytes = static_cast<size_t>(batch * per) * 2;
    for (int step = 0; step < options.steps; ++step) {
      // A = X X^T
      if (tall()) gemm::bf16_gemm_strided_batched(stream, false, true, S, S, Lg, 1.0f, y, S, per, y, S, per, 0.0f, a, S, s * s, B);
      else gemm::bf16_gemm_strided_batched(stream, true, false, S, S, Lg, 1.0f, y, Lg, per, y, Lg, per, 0.0f, a, S, s * s, B);
      // B = b A + c A A
      cuda::copy_device_to_device(b, a, gram_bytes, stream);
      gemm::bf16_gemm_strided_batched(stream, false, false, S, S, S, static_cast<float>(cc), a, S, s * s, a, S, s * s,
                                      static_cast<float>(cb), b, S, s * s, B);
      // X = a X + B X
      cuda::copy_device_to_device(next, y, y_bytes, stream);
      if (tall()) gemm::bf16_gemm_strided_batched(stream, false, false, S, Lg, S, 1.0f, b, S, s * s, y, S, per,
                                                  static_cast<float>(ca), next, S, per, B);
      else gemm::bf16_gemm_strided_batched(stream, false, true, Lg, S, S, 1.0f, y, Lg, per, b, S, s * s,
                                           static_cast<float>(ca), next, Lg, per, B);
      std::swap(y, next);
    }
    long long n = batch * per;
    void* args[] = {&y, &dtype, &n, &m};
    const long long enough = static_cast<long long>(std::max(device_.sm_count, 1)) * 16;  // grid-stride beyond that
    const unsigned grid = static_cast<unsigned>(std::min<long long>((n + kThreads - 1) / kThreads, enough));
    cuda::launch(kernels_->store, grid, kThreads, 0, stream, args);
  }

 private:
  // Work buffers, stream-ordered on the stream of the run that makes them (no host wait); a run on
  // another stream makes new ones (the old ones are freed on their stream after their last use).
  void allocate(CUstream stream, long long per, int chunks) {
    const long long s = short_side();
    const size_t batch = static_cast<size_t>(shape.batch);
    auto make = [&](size_t bytes) {
      cuda::DeviceBuffer buf = cuda::DeviceBuffer::ordered(bytes, stream);
      buf.free_on(stream);
      return buf;
    };
    y_ = make(batch * static_cast<size_t>(per) * 2);
    next_ = make(batch * static_cast<size_t>(per) * 2);
    a_ = make(batch * static_cast<size_t>(s * s) * 2);
    b_ = make(batch * static_cast<size_t>(s * s) * 2);
    partials_ = make(batch * static_cast<size_t>(chunks) * sizeof(double));
    norms_ = make(batch * sizeof(float));
    made_on_ = stream;
    made_ = true;
  }

  cuda::Device device_;
  const Kernels* kernels_;
  cuda::DeviceBuffer y_, next_, a_, b_, partials_, norms_;
  CUstream made_on_ = nullptr;
  bool made_ = false;
};

}  // namespace

std::string newton_schulz_cuda_source() {
  return dialect_prelude(cuda_dialect()) + "#define OF_NS_THREADS " + std::to_string(kThreads) +
         "\n#define OF_NS_CHUNK " + std::to_string(kChunk) + "LL\n" + kKernels;
}

std::unique_ptr<NewtonSchulz::Impl> make_cuda_newton_schulz(MatrixBatchShape shape, NewtonSchulzOptions options) {
  return std::make_unique<CudaNewtonSchulz>(shape, options);
}

}  // namespace optfuse
