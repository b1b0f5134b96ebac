// The GEMM libraries of the matrix phase, loaded with dlopen at run time (nothing links against
// them, so optfuse builds and runs where they are missing; what needs them then throws
// BackendUnavailable saying what to install):
//   OpenBLAS (CPU): cblas_sgemm, from Debian's libopenblas0 (libopenblas.so.0), or any CBLAS that
//            the loader finds as libcblas.so.3 / libblas.so.3 with cblas_sgemm;
//   cuBLAS (CUDA): cublasGemmStridedBatchedEx, from the CUDA toolkit or the nvidia-cublas wheel
//            (libcublas.so.13 / .12; a process that imported torch has it loaded already).
// Each library is loaded once per process and never unloaded, like the driver and NVRTC.
#pragma once
#include <cuda.h>

#include <string>

namespace optfuse::gemm {

// ---- CPU: row-major single-precision GEMM, C = alpha op(A) op(B) + beta C (CBLAS semantics).
bool cpu_available(std::string* why = nullptr);
void sgemm_row_major(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                     const float* b, int ldb, float beta, float* c, int ldc);

// ---- CUDA: column-major strided-batched bf16 GEMM with float32 compute (cuBLAS semantics:
// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch, A_i = A + i * stride_a, ... in elements),
// queued on `stream` with the current context's handle (one per device, made on first use).
bool cuda_available(std::string* why = nullptr);
void bf16_gemm_strided_batched(CUstream stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                               CUdeviceptr a, int lda, long long stride_a, CUdeviceptr b, int ldb,
                               long long stride_b, float beta, CUdeviceptr c, int ldc, long long stride_c,
                               int batch);

}  // namespace optfuse::gemm
