#include "runtime/host_executor.h"

#include <cmath>

#include "eval/interpreter.h"
#include "optfuse/error.h"

namespace optfuse {

HostExecutor::HostExecutor(const Plan& plan, int32_t chunk_elems) : plan_(plan), chunk_elems_(chunk_elems) {}

void HostExecutor::resize_groups(int groups) {
  const ScalarLayout& L = plan_.layout;
  std::vector<double> t(static_cast<size_t>(L.size(groups)), 0.0);
  for (int g = 0; g < groups && g < groups_; ++g)
    t[static_cast<size_t>(L.steps_offset(groups) + g)] = table_[static_cast<size_t>(L.steps_offset(groups_) + g)];
  table_ = std::move(t);
  groups_ = groups;
}

void HostExecutor::write_hypers(const std::vector<double>& hypers) {
  std::copy(hypers.begin(), hypers.end(), table_.begin() + plan_.layout.hypers_offset());
}

int64_t HostExecutor::read_step(int group) {
  return static_cast<int64_t>(table_[static_cast<size_t>(plan_.layout.steps_offset(groups_) + group)]);
}

void HostExecutor::write_step(int group, int64_t steps) {
  table_[static_cast<size_t>(plan_.layout.steps_offset(groups_) + group)] = static_cast<double>(steps);
}

void HostExecutor::set_tensors(const std::vector<TensorRef>& tensors) {
  tensors_ = tensors;
  chunks_ = build_chunks(tensors_, chunk_elems_);
  partials_.assign(plan_.reductions.size(), std::vector<double>(chunks_.size(), 0.0));
}

void HostExecutor::step(const StepInputs& in) {
  set_globals(table_.data(), in);
  for (size_t i = 0; i < plan_.phases.size(); ++i) {
    run_scalar_phase(plan_, i, table_.data(), groups_, partials_);
    run_phase(i);
  }
}

namespace {

class ReferenceExecutor : public HostExecutor {
 public:
  explicit ReferenceExecutor(const Plan& plan) : HostExecutor(plan, 65536) {}
  std::string status() const override { return "reference evaluator (float64, interpreted)"; }

 protected:
  void run_phase(size_t index) override {
    run_element_phase<double>(plan_, plan_.phases[index], tensors_, chunks_, 0, chunks_.size(), table_.data(),
                              groups_, partials_);
  }
};

}  // namespace

std::unique_ptr<Executor> make_reference_executor(const Plan& plan) {
  return std::make_unique<ReferenceExecutor>(plan);
}

}  // namespace optfuse
