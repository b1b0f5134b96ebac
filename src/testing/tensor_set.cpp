#include "testing/tensor_set.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "optfuse/error.h"

namespace optfuse::testing {

namespace {

StorageVariant uniform_storage(const Plan& plan, DType dtype) {
  StorageVariant v{{dtype, false}, {dtype, false}};
  for (const ProgramState& s : plan.program.states) v.push_back({s.fixed_dtype ? s.dtype : dtype, false});
  return v;
}

}  // namespace

HostTensorSet::HostTensorSet(const Plan& plan, const std::vector<TensorSpec>& specs, DType dtype, uint64_t seed)
    : HostTensorSet(plan, specs, uniform_storage(plan, dtype), seed) {}

HostTensorSet::HostTensorSet(const Plan& plan, const std::vector<TensorSpec>& specs, const StorageVariant& storage,
                             uint64_t seed)
    : specs_(specs), storage_(storage) {
  size_t roles = 2 + plan.program.states.size();
  if (storage.size() != roles) throw Error("HostTensorSet: the storage variant has the wrong number of roles");
  shapes_.assign(roles, StateShape::Full);
  for (size_t r = 2; r < roles; ++r) shapes_[r] = plan.program.states[r - 2].shape;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t ti = 0; ti < specs.size(); ++ti) {
    std::vector<std::vector<uint8_t>> t(roles);
    data_.emplace_back();
    for (size_t r = 0; r < roles; ++r) {
      const DType d = storage[r].dtype;
      const int64_t n = numel(ti, r);
      t[r].resize(static_cast<size_t>(d == DType::q8 ? q8_storage_bytes(n) : n * static_cast<int64_t>(dtype_size(d))));
      const ProgramState* st = r >= 2 ? &plan.program.states[r - 2] : nullptr;
      std::vector<double> values(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        double v = st == nullptr ? normal(rng) : st->init;
        if (st != nullptr && st->init_from_param) v = load_element(t[0].data(), storage[0].dtype, i);
        values[static_cast<size_t>(i)] = v;
        if (d != DType::q8) store_element(t[r].data(), d, i, v);
      }
      for (int64_t i = 0; d == DType::q8 && i < n; i += kQ8Block)  // a q8 state is written a block at a time
        store_q8_block(t[r].data(), n, i, std::min(kQ8Block, n - i), values.data() + i);
    }
    data_.back() = std::move(t);
  }
}

int64_t HostTensorSet::numel(size_t tensor, size_t role) const {
  const TensorSpec& s = specs_.at(tensor);
  const int64_t cols = s.cols > 0 ? s.cols : 1, rows = s.numel / cols;
  const int64_t matrices = s.cols > 0 && s.matrix_rows > 0 ? rows / s.matrix_rows : 1;
  switch (shapes_.at(role)) {
    case StateShape::Rows: return rows;
    case StateShape::Cols: return matrices * cols;
    default: return s.numel;
  }
}

std::vector<TensorRef> HostTensorSet::refs() {
  std::vector<TensorRef> out;
  for (size_t t = 0; t < specs_.size(); ++t) {
    TensorRef r;
    auto buf = [&](size_t role) {
      return Buffer{data_[t][role].data(), numel(t, role), storage_[role].dtype, storage_[role].stochastic};
    };
    r.param = buf(0);
    r.grad = buf(1);
    for (size_t role = 2; role < data_[t].size(); ++role) r.states.push_back(buf(role));
    r.group = specs_[t].group;
    r.cols = specs_[t].cols;
    r.matrix_rows = specs_[t].matrix_rows;
    r.rng_key = t + 1;
    out.push_back(r);
  }
  return out;
}

void HostTensorSet::randomize_grads(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t t = 0; t < specs_.size(); ++t)
    for (int64_t i = 0; i < specs_[t].numel; ++i) store_element(data_[t][1].data(), storage_[1].dtype, i, normal(rng));
}

double HostTensorSet::value(size_t tensor, size_t role, int64_t i) const {
  const DType d = storage_.at(role).dtype;
  if (d == DType::q8) return load_q8_element(data_[tensor][role].data(), numel(tensor, role), i);
  return load_element(data_[tensor][role].data(), d, i);
}

double max_relative_difference(const HostTensorSet& a, const HostTensorSet& b) {
  double worst = 0;
  for (size_t t = 0; t < b.size(); ++t) {
    for (size_t r = 0; r < b.num_roles(); ++r) {
      if (r == 1) continue;  // gradients are inputs
      const int64_t n = b.numel(t, r);
      // Below a 16-bit format's smallest normal its spacing is constant (float16: 2^-24 under 2^-14),
      // so a role whose values are all subnormal is measured against the smallest normal: one
      // subnormal ulp is then 2^-10, not a multiple of the role's (tiny) scale.
      const DType dt = b.dtype(r);
      double scale = dt == DType::f16 ? std::ldexp(1.0, -14) : dt == DType::bf16 ? std::ldexp(1.0, -126) : 0.0;
      for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(b.value(t, r, i)));
      for (int64_t i = 0; i < n; ++i) {
        double x = a.value(t, r, i), y = b.value(t, r, i);
        if (std::isnan(x) != std::isnan(y)) return NAN;
        if (std::isnan(x)) continue;
        worst = std::max(worst, std::fabs(x - y) / std::max(scale, 1e-30));
      }
    }
  }
  return worst;
}

}  // namespace optfuse::testing
