// Executors whose scalars live in host memory: the reference evaluator, and the base of the CPU
// backend. They share the scalar table, the chunk list and the scalar phases; subclasses say how
// an element phase runs over a range of chunks.
#pragma once
#include <vector>

#include "runtime/chunks.h"
#include "runtime/executor.h"
#include "runtime/matrix_tables.h"

namespace optfuse {

class HostExecutor : public Executor {
 public:
  HostExecutor(PlanPtr plan, int32_t chunk_elems);
  void resize_groups(int groups) override;
  void write_hypers(const std::vector<double>& hypers) override;
  void write_hyper_sources(const std::vector<HyperSource>& sources) override { sources_ = sources; }
  int64_t read_step(int group) override;
  void write_step(int group, int64_t steps) override;
  double read_uniform_state(int group, int slot) override;
  void write_uniform_state(int group, int slot, double value) override;
  void set_tensors(const std::vector<TensorRef>& tensors) override;
  void step(const StepInputs& in) override;
  int32_t chunk_elements() const override { return chunk_elems_; }
  void set_exchange(const ShardMap& map, ExchangeFn fn) override;

 protected:
  // Runs element phase `index` over all chunks, filling partials_ for reduce phases.
  virtual void run_phase(size_t index) = 0;
  // The Values step before pass `index` of a matrix plan (run_values_step in the backend's precision).
  virtual void run_values(size_t index) = 0;
  // The matrix tables a phase reads and writes: null unless the plan is a matrix plan.
  MatrixTables* matrix() { return plan_.matrix() ? &matrix_ : nullptr; }

  PlanPtr plan_ptr_;
  const Plan& plan_;  // *plan_ptr_, which this executor keeps alive
  int32_t chunk_elems_;
  int groups_ = 0;
  std::vector<double> table_;
  std::vector<HyperSource> sources_;  // [group][hyper]; bound values are read at every step
  std::vector<TensorRef> tensors_;
  std::vector<Chunk> chunks_;
  std::vector<std::vector<double>> partials_;  // [reduction][chunk]
  std::vector<double> tensor_reductions_;      // [tensor][per-tensor reduction slot]
  std::vector<ChunkRange> spans_;              // per tensor, its chunks in chunks_
  MatrixTables matrix_;                        // matrix plans: row and column tables

 private:
  void exchange(int phase);
  void combine(int phase);
  // A sharded step's exchange (Optimizer::set_exchange): empty fn when unsharded.
  ExchangeFn exchange_fn_;
  int64_t global_chunks_ = 0;
  std::vector<ChunkRange> global_spans_;       // per tensor, its whole tensor's chunks in global order
  std::vector<double> local_, global_;         // [reduction][local chunk], [reduction][global chunk]
};

}  // namespace optfuse
