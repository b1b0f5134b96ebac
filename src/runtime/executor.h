// What a backend implements. The Optimizer keeps hyperparameters on the host and hands the
// executor the scalar table layout; the executor owns the table's storage (host or device), the
// tensor table and the generated code, and runs the phases of a step.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse {

class Executor {
 public:
  virtual ~Executor() = default;
  // Resizes the scalar table for `groups` groups, keeping step counts of existing groups.
  virtual void resize_groups(int groups) = 0;
  // Writes the hyperparameter area ([group][hyper], plan layout).
  virtual void write_hypers(const std::vector<double>& hypers) = 0;
  virtual int64_t read_step(int group) = 0;
  virtual void write_step(int group, int64_t steps) = 0;
  // Tensors were validated by the Optimizer.
  virtual void set_tensors(const std::vector<TensorRef>& tensors) = 0;
  // Same tensors (sizes, dtypes, groups), new data pointers: backends may skip rebuilding chunks.
  virtual void update_pointers(const std::vector<TensorRef>& tensors) { set_tensors(tensors); }
  virtual void step(const StepInputs& in) = 0;
  virtual std::string source() const { return {}; }
  virtual std::string status() const = 0;
};

std::unique_ptr<Executor> make_reference_executor(const Plan& plan);
std::unique_ptr<Executor> make_cpu_executor(const Plan& plan);
std::unique_ptr<Executor> make_cuda_executor(const Plan& plan);

}  // namespace optfuse
