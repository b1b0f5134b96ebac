// The backends of optfuse::NewtonSchulz (include/optfuse/newton_schulz.h). Both compute, per matrix,
// with s = min(rows, cols) and l = max(rows, cols), X the s x l matrix (M or its transpose):
//   X = bf16(M); n = bf16(max(bf16(||X||_F), eps)); X = bf16(X / n)
//   steps times: A = bf16(X X^T); B = bf16(b A + c A A); X = bf16(a X + B X)
// with float32 products and sums (torch.optim.Muon's arithmetic for bfloat16; the order of a
// product's sum is the library's).
#pragma once
#include <memory>
#include <string>

#include "optfuse/newton_schulz.h"

namespace optfuse {

struct NewtonSchulz::Impl {
  MatrixBatchShape shape;
  NewtonSchulzOptions options;
  Impl(MatrixBatchShape s, NewtonSchulzOptions o) : shape(s), options(o) {}
  virtual ~Impl() = default;
  virtual void run(void* data, void* stream) = 0;
  int64_t short_side() const { return shape.rows < shape.cols ? shape.rows : shape.cols; }
  int64_t long_side() const { return shape.rows < shape.cols ? shape.cols : shape.rows; }
  bool tall() const { return shape.rows > shape.cols; }
};

std::unique_ptr<NewtonSchulz::Impl> make_cpu_newton_schulz(MatrixBatchShape shape, NewtonSchulzOptions options);
std::unique_ptr<NewtonSchulz::Impl> make_cuda_newton_schulz(MatrixBatchShape shape, NewtonSchulzOptions options);

// The CUDA kernels of the matrix phase (the norm partials, the scaled bf16 copy, the store back),
// compiled with NVRTC on first use; exposed so a test can compile them without a GPU.
std::string newton_schulz_cuda_source();

}  // namespace optfuse
