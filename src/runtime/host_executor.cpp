#include "runtime/host_executor.h"

#include <cmath>

#include "eval/interpreter.h"
#include "optfuse/error.h"

namespace optfuse {

HostExecutor::HostExecutor(PlanPtr plan, int32_t chunk_elems)
    : plan_ptr_(std::move(plan)), plan_(*plan_ptr_), chunk_elems_(chunk_elems) {}

void HostExecutor::resize_groups(int groups) {
  const ScalarLayout& L = plan_.layout;
  std::vector<double> t(static_cast<size_t>(L.size(groups)), 0.0);
  const auto& ustates = plan_.program.uniform_states;
  const int S = L.uniform_states_per_group;
  for (int g = 0; g < groups; ++g) {
    const bool kept = g < groups_;
    if (kept)
      t[static_cast<size_t>(L.steps_offset(groups) + g)] = table_[static_cast<size_t>(L.steps_offset(groups_) + g)];
    for (int u = 0; u < S; ++u)
      t[static_cast<size_t>(L.uniform_states_offset(groups) + g * S + u)] =
          kept ? table_[static_cast<size_t>(L.uniform_states_offset(groups_) + g * S + u)]
               : ustates[static_cast<size_t>(u)].init;
  }
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

double HostExecutor::read_uniform_state(int group, int slot) {
  const ScalarLayout& L = plan_.layout;
  return table_[static_cast<size_t>(L.uniform_states_offset(groups_) + group * L.uniform_states_per_group + slot)];
}

void HostExecutor::write_uniform_state(int group, int slot, double value) {
  const ScalarLayout& L = plan_.layout;
  table_[static_cast<size_t>(L.uniform_states_offset(groups_) + group * L.uniform_states_per_group + slot)] = value;
}

void HostExecutor::set_tensors(const std::vector<TensorRef>& tensors) {
  tensors_ = tensors;
  chunks_ = build_chunks(tensors_, chunk_elems_, plan_.matrix());
  partials_.assign(plan_.reductions.size(), std::vector<double>(chunks_.size(), 0.0));
  tensor_reductions_.assign(tensors_.size() * static_cast<size_t>(plan_.layout.tensor_reductions), 0.0);
  spans_ = chunk_ranges(tensors_.size(), chunks_);
  if (plan_.matrix()) matrix_.build(plan_, tensors_, spans_);
}

void HostExecutor::set_exchange(const ShardMap& map, ExchangeFn fn) {
  exchange_fn_ = std::move(fn);
  global_chunks_ = exchange_fn_ ? map.global_chunks : 0;
  global_spans_.clear();
  if (exchange_fn_)
    for (const ChunkSpan& sp : map.tensors)
      global_spans_.push_back({static_cast<uint32_t>(sp.first), static_cast<uint32_t>(sp.count)});
  global_.assign(plan_.reductions.size() * static_cast<size_t>(global_chunks_), 0.0);
  local_.assign(exchange_fn_ ? plan_.reductions.size() * chunks_.size() : 0, 0.0);
}

void HostExecutor::exchange(int phase) {
  if (!exchange_fn_) return;
  PartialSums ps;
  ps.phase = phase;
  ps.local_chunks = static_cast<int64_t>(chunks_.size());
  for (NodeId node : plan_.phases[static_cast<size_t>(phase)].reductions) {
    const size_t r = plan_.reduction_index(node);
    ps.reductions.push_back(static_cast<int>(r));
    std::copy(partials_[r].begin(), partials_[r].end(), local_.begin() + static_cast<std::ptrdiff_t>(r * chunks_.size()));
  }
  ps.local = local_.data();
  ps.global_chunks = global_chunks_;
  ps.global = global_.data();
  exchange_fn_(ps);
}

void HostExecutor::combine(int phase) {
  if (exchange_fn_) {
    const size_t G = static_cast<size_t>(global_chunks_);
    combine_partials(plan_, static_cast<size_t>(phase), [&](size_t r) { return global_.data() + r * G; }, global_spans_,
                     global_chunks_, table_.data(), tensor_reductions_);
  } else {
    combine_partials(plan_, static_cast<size_t>(phase), [&](size_t r) { return partials_[r].data(); }, spans_,
                     static_cast<int64_t>(chunks_.size()), table_.data(), tensor_reductions_, matrix());
  }
}

void HostExecutor::step(const StepInputs& in) {
  set_globals(table_.data(), in);
  // Bound hyperparameters: read now, so a change made since the last step is seen by this one.
  const int hyp = plan_.layout.hypers_offset();
  for (size_t k = 0; k < sources_.size(); ++k) {
    const HyperSource& s = sources_[k];
    if (s.ptr == 0) continue;
    const void* p = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.ptr));
    table_[static_cast<size_t>(hyp) + k] = s.type == 1 ? *static_cast<const double*>(p)
                                                       : static_cast<double>(*static_cast<const float*>(p));
  }
  for (const ScheduleStep& st : plan_.schedule) {
    switch (st.kind) {
      case ScheduleStep::Kind::Scalar: run_scalar_phase(plan_, static_cast<size_t>(st.phase), table_.data(), groups_); break;
      case ScheduleStep::Kind::Pass: run_phase(static_cast<size_t>(st.phase)); break;
      case ScheduleStep::Kind::Exchange: exchange(st.phase); break;
      case ScheduleStep::Kind::Combine: combine(st.phase); break;
      case ScheduleStep::Kind::Values: run_values(static_cast<size_t>(st.phase)); break;
      case ScheduleStep::Kind::Commit: commit_matrix_states(plan_, tensors_, table_.data(), groups_, matrix_); break;
    }
  }
}

namespace {

class ReferenceExecutor : public HostExecutor {
 public:
  explicit ReferenceExecutor(PlanPtr plan) : HostExecutor(std::move(plan), optfuse::chunk_elements(Backend::reference)) {}
  std::string status() const override { return "reference evaluator (float64, interpreted)"; }

 protected:
  void run_phase(size_t index) override {
    run_element_phase<double>(plan_, index, tensors_, chunks_, 0, chunks_.size(), table_.data(),
                              groups_, tensor_reductions_, partials_, matrix());
  }
  void run_values(size_t index) override {
    run_values_step<double>(plan_, index, tensors_, table_.data(), groups_, tensor_reductions_, matrix_);
  }
};

}  // namespace

std::unique_ptr<Executor> make_reference_executor(PlanPtr plan) {
  return std::make_unique<ReferenceExecutor>(std::move(plan));
}

}  // namespace optfuse
