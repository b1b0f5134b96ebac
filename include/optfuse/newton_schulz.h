// The matrix phase of a Muon step: Newton-Schulz orthogonalisation of a batch of same-shape
// matrices, as torch.optim.Muon's _zeropower_via_newtonschulz computes each one, in bfloat16 with
// float32 accumulation:
//
//   X = bf16(M), transposed if M is tall (rows > cols)
//   X = X / max(||X||_F, eps)
//   repeat steps times:  A = X X^T;  B = b A + c A A;  X = a X + B X      (each result rounded to bf16)
//   M = X (transposed back), in M's storage dtype
//
// The products are library GEMMs, never hand-written: cuBLAS strided-batched GEMMs on CUDA (bf16
// inputs and outputs, float32 compute: the tensor cores), loaded at run time like the driver and
// NVRTC, so nothing links against it; on the CPU, OpenBLAS's sgemm (Debian's libopenblas0) on
// float32 buffers that hold bf16 values, each result rounded to bf16: the same arithmetic as a bf16
// GEMM with float32 accumulation. Transposition is never a copy on CUDA (a row-major matrix is its
// transpose in column-major, so each GEMM picks its operands' op flags).
//
//   optfuse::NewtonSchulz ns(optfuse::Backend::cuda, {DType::f32, 12, 768, 3072});
//   ns.run(device_pointer, stream);   // queued on the stream, no host synchronisation
//
// The orthogonaliser owns its work buffers (made on its first run, on that run's stream) and
// reuses them every step. See docs/architecture.md ("The matrix phase").
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "optfuse/dtype.h"
#include "optfuse/optimizer.h"

namespace optfuse {

// (NewtonSchulzOptions, torch.optim.Muon's settings, is in optfuse/rule.h: a matrix rule carries it.)

// `batch` row-major rows x cols matrices, one after another, of float32, float16 or bfloat16.
struct MatrixBatchShape {
  DType dtype = DType::f32;
  int64_t batch = 0, rows = 0, cols = 0;
  int64_t numel() const { return batch * rows * cols; }
};

// Whether the GEMM library of `backend` loads (cpu: OpenBLAS; cuda: cuBLAS and the driver). Never
// throws; on false, *why says what is missing. The reference backend has none.
bool gemm_available(Backend backend, std::string* why = nullptr);

class NewtonSchulz {
 public:
  // Throws optfuse::Error for a bad shape, dtype or options, BackendUnavailable when the backend's
  // GEMM library is missing (Backend::reference is refused: there is no float64 Newton-Schulz).
  NewtonSchulz(Backend backend, MatrixBatchShape shape, NewtonSchulzOptions options = {});
  ~NewtonSchulz();
  NewtonSchulz(NewtonSchulz&&) noexcept;
  NewtonSchulz& operator=(NewtonSchulz&&) noexcept;

  // Orthogonalises the batch at `data` in place (host memory for cpu, device memory for cuda). On
  // CUDA the work is queued on `stream` (a CUstream; nullptr: the default stream) and run returns
  // without waiting; the data must stay valid until it has run.
  void run(void* data, void* stream = nullptr);

  const MatrixBatchShape& shape() const;
  const NewtonSchulzOptions& options() const;
  // FLOPs of one run's matrix products (2 m n k per product): what a benchmark divides by time.
  double flops() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace optfuse
