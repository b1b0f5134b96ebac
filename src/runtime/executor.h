// What a backend implements. The Optimizer keeps hyperparameters on the host and hands the
// executor the scalar table layout; the executor owns the table's storage (host or device), the
// tensor table and the generated code, and runs the phases of a step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse {

// Where one [group][hyperparameter] value comes from at each step (Optimizer::bind_hyper): ptr == 0
// means the table (the last set_hyper value); otherwise a float32 (type 0) or float64 (type 1)
// scalar, in device memory for CUDA. 16 bytes: the generated struct OfHyperSource matches.
struct HyperSource {
  uint64_t ptr = 0;
  int32_t type = 0;
  int32_t pad = 0;
};
static_assert(sizeof(HyperSource) == 16, "HyperSource is shared with generated code");

class Executor {
 public:
  virtual ~Executor() = default;
  // Resizes the scalar table for `groups` groups, keeping step counts and uniform states of existing
  // groups; new groups' uniform states start at their init values.
  virtual void resize_groups(int groups) = 0;
  // Writes the hyperparameter area ([group][hyper], plan layout).
  virtual void write_hypers(const std::vector<double>& hypers) = 0;
  // Writes the hyperparameter sources ([group][hyper], same layout as write_hypers).
  virtual void write_hyper_sources(const std::vector<HyperSource>& sources) = 0;
  virtual int64_t read_step(int group) = 0;
  virtual void write_step(int group, int64_t steps) = 0;
  // A group's uniform state `slot` (Program::uniform_states), as committed by the last step.
  virtual double read_uniform_state(int group, int slot) = 0;
  virtual void write_uniform_state(int group, int slot, double value) = 0;
  // Tensors were validated by the Optimizer.
  virtual void set_tensors(const std::vector<TensorRef>& tensors) = 0;
  // Same tensors (sizes, dtypes, groups), new data pointers: backends may skip rebuilding chunks.
  virtual void update_pointers(const std::vector<TensorRef>& tensors) { set_tensors(tensors); }
  // Same tensors, and only gradient pointers moved (every step of a loop that zeroes gradients to
  // None): backends rewrite the gradient words alone.
  virtual void update_grad_pointers(const std::vector<TensorRef>& tensors) { update_pointers(tensors); }
  virtual void step(const StepInputs& in) = 0;
  // Elements per chunk (the unit of partial sums, so of sharding).
  virtual int32_t chunk_elements() const = 0;
  // Validated by the Optimizer (Optimizer::set_exchange); an empty fn clears it (Optimizer::set_tensors
  // does). update_pointers keeps it.
  virtual void set_exchange(const ShardMap& map, ExchangeFn fn) = 0;
  virtual std::string source() const { return {}; }
  virtual std::string status() const = 0;
};

// Executors share ownership of the plan they run: an Optimizer may move (or be moved from) while its
// executor lives on, so nothing may refer into the Optimizer itself.
using PlanPtr = std::shared_ptr<const Plan>;
std::unique_ptr<Executor> make_reference_executor(PlanPtr plan);
std::unique_ptr<Executor> make_cpu_executor(PlanPtr plan);
std::unique_ptr<Executor> make_cuda_executor(PlanPtr plan);

}  // namespace optfuse
