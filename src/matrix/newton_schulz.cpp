#include "optfuse/newton_schulz.h"

#include <limits>

#include "matrix/gemm_libraries.h"
#include "matrix/newton_schulz_impl.h"
#include "optfuse/error.h"

namespace optfuse {

bool gemm_available(Backend backend, std::string* why) {
  switch (backend) {
    case Backend::cpu: return gemm::cpu_available(why);
    case Backend::cuda: return gemm::cuda_available(why);
    case Backend::reference: break;
  }
  if (why) *why = "the reference backend has no matrix phase (Newton-Schulz runs in bfloat16 on cpu or cuda)";
  return false;
}

namespace {

void validate(const MatrixBatchShape& s, const NewtonSchulzOptions& o) {
  if (s.dtype != DType::f32 && s.dtype != DType::bf16 && s.dtype != DType::f16)
    throw Error(std::string("NewtonSchulz: matrices must be float32, float16 or bfloat16, got ") + dtype_name(s.dtype));
  if (s.batch < 1 || s.rows < 1 || s.cols < 1)
    throw Error("NewtonSchulz: batch, rows and cols must be positive, got " + std::to_string(s.batch) + " x " +
                std::to_string(s.rows) + " x " + std::to_string(s.cols));
  // cuBLAS and CBLAS take int sizes and leading dimensions; batch strides are 64-bit.
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (s.rows > kMax || s.cols > kMax || s.batch > kMax || s.rows * s.cols > (int64_t{1} << 40))
    throw Error("NewtonSchulz: matrices of " + std::to_string(s.rows) + " x " + std::to_string(s.cols) +
                " (batch " + std::to_string(s.batch) + ") are too large for a GEMM library call");
  if (const std::string why = o.problem(); !why.empty()) throw Error("NewtonSchulz: " + why);
}

}  // namespace

NewtonSchulz::NewtonSchulz(Backend backend, MatrixBatchShape shape, NewtonSchulzOptions options) {
  validate(shape, options);
  std::string why;
  if (!gemm_available(backend, &why)) {
    if (backend == Backend::reference) throw Error(why);
    throw BackendUnavailable(why);
  }
  impl_ = backend == Backend::cuda ? make_cuda_newton_schulz(shape, options) : make_cpu_newton_schulz(shape, options);
}

NewtonSchulz::~NewtonSchulz() = default;
NewtonSchulz::NewtonSchulz(NewtonSchulz&&) noexcept = default;
NewtonSchulz& NewtonSchulz::operator=(NewtonSchulz&&) noexcept = default;

void NewtonSchulz::run(void* data, void* stream) {
  if (!impl_) throw Error("NewtonSchulz: used after being moved from");
  if (!data) throw Error("NewtonSchulz::run: null data");
  impl_->run(data, stream);
}

const MatrixBatchShape& NewtonSchulz::shape() const {
  if (!impl_) throw Error("NewtonSchulz: used after being moved from");
  return impl_->shape;
}
const NewtonSchulzOptions& NewtonSchulz::options() const {
  if (!impl_) throw Error("NewtonSchulz: used after being moved from");
  return impl_->options;
}

double NewtonSchulz::flops() const {
  if (!impl_) throw Error("NewtonSchulz: used after being moved from");
  const Impl& i = *impl_;
  const double s = static_cast<double>(i.short_side()), l = static_cast<double>(i.long_side());
  // X X^T (s x s x l), A A (s x s x s), B X (s x l x s), 2 FLOPs per multiply-add.
  return static_cast<double>(i.shape.batch) * i.options.steps * (2 * s * s * l + 2 * s * s * s + 2 * s * l * s);
}

}  // namespace optfuse
