// The CPU matrix phase: float32 buffers holding bf16 values, OpenBLAS sgemm for every product, each
// result rounded to bf16 (a bf16 GEMM with float32 accumulation). Matrices of the batch run one
// after another; OpenBLAS spreads each product over its threads.
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "matrix/gemm_libraries.h"
#include "matrix/newton_schulz_impl.h"

namespace optfuse {

namespace {

float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }
void round_all_bf16(std::vector<float>& v) {
  for (float& x : v) x = round_bf16(x);
}

class CpuNewtonSchulz final : public NewtonSchulz::Impl {
 public:
  using Impl::Impl;

  void run(void* data, void*) override {
    const int64_t s = short_side(), l = long_side(), per = s * l;
    x_.resize(static_cast<size_t>(per));
    next_.resize(static_cast<size_t>(per));
    a_.resize(static_cast<size_t>(s * s));
    b_.resize(static_cast<size_t>(s * s));
    for (int64_t m = 0; m < shape.batch; ++m) orthogonalise(data, m * per);
  }

 private:
  // X[i][j] = M[i][j] (wide) or M[j][i] (tall): X is s x l, row-major.
  int64_t index_in_m(int64_t i, int64_t j) const { return tall() ? j * shape.cols + i : i * shape.cols + j; }

  void orthogonalise(void* data, int64_t first) {
    const int s = static_cast<int>(short_side()), l = static_cast<int>(long_side());
    const auto [ca, cb, cc] = options.coefficients;
    double sum_sq = 0;
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < l; ++j) {
        const float v = round_bf16(static_cast<float>(load_element(data, shape.dtype, first + index_in_m(i, j))));
        x_[static_cast<size_t>(i) * l + j] = v;
        sum_sq += static_cast<double>(v) * v;
      }
    // torch: ortho_grad.div_(ortho_grad.norm().clamp(min=eps)), all in bf16 tensors
    float norm = round_bf16(static_cast<float>(std::sqrt(sum_sq)));
    norm = round_bf16(std::fmax(norm, static_cast<float>(options.eps)));
    for (float& v : x_) v = round_bf16(v / norm);
    for (int step = 0; step < options.steps; ++step) {
      // A = X X^T
      gemm::sgemm_row_major(false, true, s, s, l, 1.0f, x_.data(), l, x_.data(), l, 0.0f, a_.data(), s);
      round_all_bf16(a_);
      // B = b A + c A A
      b_ = a_;
      gemm::sgemm_row_major(false, false, s, s, s, static_cast<float>(cc), a_.data(), s, a_.data(), s,
                            static_cast<float>(cb), b_.data(), s);
      round_all_bf16(b_);
      // X = a X + B X
      next_ = x_;
      gemm::sgemm_row_major(false, false, s, l, s, 1.0f, b_.data(), s, x_.data(), l, static_cast<float>(ca),
                            next_.data(), l);
      round_all_bf16(next_);
      std::swap(x_, next_);
    }
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < l; ++j) store_element(data, shape.dtype, first + index_in_m(i, j), x_[static_cast<size_t>(i) * l + j]);
  }

  std::vector<float> x_, next_, a_, b_;
};

}  // namespace

std::unique_ptr<NewtonSchulz::Impl> make_cpu_newton_schulz(MatrixBatchShape shape, NewtonSchulzOptions options) {
  return std::make_unique<CpuNewtonSchulz>(shape, options);
}

}  // namespace optfuse
