// A chain with a matrix phase (Muon: momentum -> Newton-Schulz of each whole matrix -> decay and
// lr): the chain is split at its matrix rule (Rule::matrix_phase) into two element-wise parts, each
// an Optimizer with its own plan, around the matrix phase (optfuse/newton_schulz.h). A step is
//
//   part 1's schedule   its passes read the gradients; its last pass writes each tensor's update
//                       into the tensor's scratch matrix (part 1's parameter role is the scratch:
//                       rules before the matrix rule may not read the parameter)
//   matrix              Newton-Schulz of every scratch matrix, batched over same-shape matrices of one
//                       dtype (one NewtonSchulz per bucket: cuBLAS or OpenBLAS products)
//   part 2's schedule   its passes read the orthogonalised scratch as their gradient
//
// so Muon is one pass in, the matrix phase, one pass out. describe() prints it.
//
//   optfuse::MatrixChainOptimizer opt(optfuse::make_builtin("muon", {{"lr", 0.02}}), optfuse::Backend::cuda);
//   opt.set_tensors({TensorRef{param, grad, {momentum_buffer}, 0, 0, 0, /*cols=*/n}});  // every tensor 2-D
//   opt.step({nullptr, nullptr, stream});
//
// On CUDA, as with Optimizer, the stream of the last step must outlive the optimizer: its work
// buffers are freed on that stream.
// Tensors: as Optimizer's, with states in the chain's order (part 1's, then part 2's; states() lists
// them) and a matrix view (TensorRef::cols > 0) on every tensor. The optimizer owns the scratch
// matrices (one contiguous buffer per bucket, in the parameter's dtype).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "optfuse/newton_schulz.h"
#include "optfuse/optimizer.h"

namespace optfuse {

class MatrixChainOptimizer {
 public:
  // Throws optfuse::Error unless the chain has exactly one matrix rule, with element-wise rules
  // before it (that do not read the parameter) and after it.
  MatrixChainOptimizer(const Chain& chain, Backend backend, int groups = 1);
  ~MatrixChainOptimizer();
  MatrixChainOptimizer(MatrixChainOptimizer&&) noexcept;
  MatrixChainOptimizer& operator=(MatrixChainOptimizer&&) noexcept;

  Backend backend() const;
  int num_groups() const;
  int add_group();
  // Sets the hyperparameter in every part that has it (a name both parts use, like lr, in both);
  // throws optfuse::Error if neither has it.
  void set_hyper(int group, const std::string& name, double value);
  double hyper(int group, const std::string& name) const;
  int64_t step_count(int group) const;
  // Every state slot, in the chain's order (the order of TensorRef::states).
  std::vector<ProgramState> states() const;
  const NewtonSchulzOptions& matrix_options() const;
  // The parts: 0 before the matrix phase, 1 after it.
  const Optimizer& part(int i) const;

  void set_tensors(const std::vector<TensorRef>& tensors);
  // Same sizes and dtypes, new gradient buffers (see Optimizer::set_grad_pointers).
  void set_grad_pointers(const std::vector<const void*>& grads);
  // grad_scale reaches part 1 (the gradients; a chain starting with unscale_by_grad_scale divides by
  // it); *found_inf != 0 skips both parts (each starts with a skip_if_found_inf rule). Rules that
  // skip on anything else are refused at construction: the parts must skip together.
  void step(const StepInputs& inputs = {});
  // The step schedule: part 1's steps, the matrix phase (with the buckets of the current tensors),
  // part 2's steps, each with its bytes per element.
  std::string describe() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// True if some rule of the chain is a matrix rule (then MatrixChainOptimizer runs it, not Optimizer).
bool has_matrix_phase(const Chain& chain);

// A chain cut at its matrix rule: what MatrixChainOptimizer builds its parts from, and what
// `optfuse explain` plans. Throws optfuse::Error unless there is exactly one matrix rule with
// rules before and after it, none of which skips a step on anything but found_inf.
struct MatrixChainParts {
  // skip_if_found_inf, the rules before the matrix rule, then one that stores the update in the scratch
  Chain before;
  NewtonSchulzOptions matrix;
  std::string matrix_signature;  // "newton_schulz(a=3.4445, ...)"
  Chain after;             // skip_if_found_inf, then the rules after it
};
MatrixChainParts split_matrix_chain(const Chain& chain);
// Throws optfuse::Error if part 1's plan reads the parameter (its parameter role is the scratch).
void check_matrix_chain_part1(const Plan& before);

}  // namespace optfuse
