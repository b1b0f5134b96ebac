#include "matrix/gemm_libraries.h"

#include <cublas_api.h>
#include <dlfcn.h>

#include <map>
#include <mutex>

#include "optfuse/error.h"
#include "runtime/cuda_api.h"

namespace optfuse::gemm {

namespace {

// The first library of `names` that loads and has `symbol`; *errors collects why the others did not.
void* load_symbol(std::initializer_list<const char*> names, const char* symbol, std::string* errors) {
  for (const char* n : names) {
    void* lib = ::dlopen(n, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = ::dlerror();
      *errors += std::string("\n  ") + (e ? e : n);
      continue;
    }
    if (void* f = ::dlsym(lib, symbol)) return f;
    *errors += std::string("\n  ") + n + " has no " + symbol;
  }
  return nullptr;
}

// ---- OpenBLAS / CBLAS
enum CblasOrder { kRowMajor = 101 };
enum CblasTranspose { kNoTrans = 111, kTrans = 112 };
using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc);

struct Cblas {
  SgemmFn sgemm = nullptr;
  std::string why;
};
const Cblas& cblas() {
  static const Cblas s = [] {
    Cblas c;
    std::string errors;
    c.sgemm = reinterpret_cast<SgemmFn>(load_symbol(
        {"libopenblas.so.0", "libopenblas.so", "libcblas.so.3", "libblas.so.3"}, "cblas_sgemm", &errors));
    if (!c.sgemm)
      c.why = "no CBLAS library with cblas_sgemm found (install Debian's libopenblas0, which the "
              "matrix phase uses on the CPU):" + errors;
    return c;
  }();
  return s;
}

// ---- cuBLAS
using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
using SetStreamFn = cublasStatus_t (*)(cublasHandle_t, CUstream);
using StatusStringFn = const char* (*)(cublasStatus_t);
using GemmBatchedFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                         const void*, const void*, cudaDataType, int, long long, const void*,
                                         cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                         long long, int, cublasComputeType_t, cublasGemmAlgo_t);
struct Cublas {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  StatusStringFn status_string = nullptr;
  GemmBatchedFn gemm = nullptr;
  std::string why;
};
const Cublas& cublas() {
  static const Cublas s = [] {
    Cublas c;
    std::string errors;
    void* create = load_symbol({"libcublas.so.13", "libcublas.so.12", "libcublas.so",
                                "/usr/local/cuda/lib64/libcublas.so.13", "/usr/local/cuda/lib64/libcublas.so"},
                               "cublasCreate_v2", &errors);
    if (!create) {
      c.why = "cuBLAS not found (the CUDA toolkit's or the nvidia-cublas wheel's libcublas.so.13 on the "
              "loader's path; the matrix phase runs its products there):" + errors;
      return c;
    }
    Dl_info info{};
    void* lib = ::dladdr(create, &info) && info.dli_fname ? ::dlopen(info.dli_fname, RTLD_NOW | RTLD_LOCAL) : nullptr;
    c.create = reinterpret_cast<CreateFn>(create);
    if (lib) {
      c.set_stream = reinterpret_cast<SetStreamFn>(::dlsym(lib, "cublasSetStream_v2"));
      c.status_string = reinterpret_cast<StatusStringFn>(::dlsym(lib, "cublasGetStatusString"));
      c.gemm = reinterpret_cast<GemmBatchedFn>(::dlsym(lib, "cublasGemmStridedBatchedEx"));
    }
    if (!c.set_stream || !c.gemm) c.why = "cuBLAS library unusable: it lacks cublasSetStream_v2 or cublasGemmStridedBatchedEx";
    return c;
  }();
  return s;
}

void check(cublasStatus_t st, const char* fn) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  const char* text = cublas().status_string ? cublas().status_string(st) : nullptr;
  throw Error(std::string("cuBLAS error in ") + fn + ": " + (text ? text : "status " + std::to_string(st)));
}

// One handle per device for the process (a handle is bound to the device current at its creation;
// never destroyed: kernels queued with it may still run at exit). A handle's stream is its state, so
// setting it and queuing a product happen under this lock, which the caller holds.
std::mutex handles_mutex;
cublasHandle_t handle_for_current_device() {
  static std::map<int, cublasHandle_t> handles;
  const int device = cuda::current_device().ordinal;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasHandle_t h = nullptr;
  check(cublas().create(&h), "cublasCreate_v2");
  handles.emplace(device, h);
  return h;
}

}  // namespace

bool cpu_available(std::string* why) {
  if (why) *why = cblas().why;
  return cblas().sgemm != nullptr;
}

void sgemm_row_major(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                     const float* b, int ldb, float beta, float* c, int ldc) {
  if (!cblas().sgemm) throw BackendUnavailable(cblas().why);
  cblas().sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta, c, ldc);
}

bool cuda_available(std::string* why) {
  std::string driver;
  if (!cuda::driver_available(&driver)) {
    if (why) *why = driver;
    return false;
  }
  if (why) *why = cublas().why;
  return cublas().why.empty();
}

void bf16_gemm_strided_batched(CUstream stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                               CUdeviceptr a, int lda, long long stride_a, CUdeviceptr b, int ldb,
                               long long stride_b, float beta, CUdeviceptr c, int ldc, long long stride_c,
                               int batch) {
  if (!cublas().why.empty()) throw BackendUnavailable(cublas().why);
  std::lock_guard<std::mutex> lock(handles_mutex);
  cublasHandle_t h = handle_for_current_device();
  check(cublas().set_stream(h, stream), "cublasSetStream_v2");
  const auto op = [](bool t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; };
  check(cublas().gemm(h, op(trans_a), op(trans_b), m, n, k, &alpha, reinterpret_cast<const void*>(a), CUDA_R_16BF,
                      lda, stride_a, reinterpret_cast<const void*>(b), CUDA_R_16BF, ldb, stride_b, &beta,
                      reinterpret_cast<void*>(c), CUDA_R_16BF, ldc, stride_c, batch, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

}  // namespace optfuse::gemm
