// Host-side sets of parameter tensors with gradients and state, for the CLI, benchmarks and tests:
// random parameters and gradients from a seed, states at their init values.
#pragma once
#include <cstdint>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/optimizer.h"

namespace optfuse::testing {

struct TensorSpec {
  int64_t numel;
  int group = 0;
  int64_t cols = 0;  // the matrix view (TensorRef::cols): Rows / Cols states get one value per row / column
  int64_t matrix_rows = 0;  // a batch of matrices of this many rows (TensorRef::matrix_rows; Cols: per matrix)
};

class HostTensorSet {
 public:
  // Every role in `dtype` (fixed-dtype states of the plan's precision options in theirs).
  HostTensorSet(const Plan& plan, const std::vector<TensorSpec>& specs, DType dtype, uint64_t seed);
  // Each role as `storage` says (param, grad, states: dtype and stochastic rounding). Parameters are
  // random numbers rounded to the parameter's dtype; a master copy starts as the parameter. Tensor
  // t's random stream is rng_key t + 1, rng_offset 0.
  HostTensorSet(const Plan& plan, const std::vector<TensorSpec>& specs, const StorageVariant& storage, uint64_t seed);
  // References into this set's memory.
  std::vector<TensorRef> refs();
  // New random gradients (step-dependent), as a training loop would produce.
  void randomize_grads(uint64_t seed);
  size_t size() const { return specs_.size(); }
  DType dtype() const { return storage_.at(0).dtype; }  // the parameter's
  DType dtype(size_t role) const { return storage_.at(role).dtype; }
  size_t num_roles() const { return data_.empty() ? 0 : data_[0].size(); }
  const std::vector<TensorSpec>& specs() const { return specs_; }
  // role 0 param, 1 grad, 2+s state s
  std::vector<uint8_t>& bytes(size_t tensor, size_t role) { return data_[tensor][role]; }
  double value(size_t tensor, size_t role, int64_t i) const;
  // Elements of a role of a tensor (a Rows / Cols state: its rows / columns).
  int64_t numel(size_t tensor, size_t role) const;

 private:
  std::vector<TensorSpec> specs_;
  std::vector<StateShape> shapes_;  // per role
  StorageVariant storage_;
  std::vector<std::vector<std::vector<uint8_t>>> data_;  // [tensor][role] bytes
};

// Largest |a - b| / max(scale, 1e-30) over every role of every tensor, where scale is the largest
// |b| of that role's tensor (errors relative to the parameter scale), or the role's 16-bit dtype's
// smallest normal if larger (below it the spacing is constant). NaN where exactly one is NaN.
double max_relative_difference(const HostTensorSet& a, const HostTensorSet& b);

}  // namespace optfuse::testing
