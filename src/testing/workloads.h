// Benchmark workloads: the tensor shapes of real models (and two synthetic extremes), plus the
// host memory the CPU benchmark steps. Shapes are what the optimizer sees, one tensor per
// parameter (weights and biases separately), in the model's own order:
//   gpt2-small   148 tensors, 124,439,808 elements (GPT-2 124M, tied head counted once)
//   llama-1b     147 tensors, 1,498,482,688 elements (Llama 3.2 1B shapes, untied head)
//   many-small   2000 x 4096 (launch/dispatch overhead dominates)
//   one-big      1 x 268,435,456 (pure streaming)
//   cpu-default  1 x 67,108,864 (the README's CPU job: 64M float32 elements)
// `scale` multiplies every tensor's element count (truncated, at least 1 element each) so the big
// workloads fit small machines while keeping the same tensor count and proportions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optfuse/optimizer.h"
#include "testing/tensor_set.h"

namespace optfuse::testing {

struct NamedTensor {
  std::string name;  // "h.3.attn.c_attn.weight": for messages and --json, never for lookups
  int64_t numel = 0;
};

struct Workload {
  std::string name;
  double scale = 1.0;
  std::vector<NamedTensor> tensors;
  int64_t total_elements() const;
  std::vector<TensorSpec> specs(int group = 0) const;  // one group for every tensor
};

// Known workload names, in the order --help lists them.
std::vector<std::string> workload_names();

// Throws optfuse::Error for an unknown name (listing the known ones) or a scale that is not a
// positive finite number.
Workload make_workload(const std::string& name, double scale = 1.0);

// Host memory for a workload: one 64-byte-aligned arena per role (param, grad, states) with every
// tensor at a 64-byte-aligned offset, so vector loads never split a cache line at a tensor's start
// (as with any real allocator). Filled in parallel on the default thread pool -- the same threads
// that later step it touch the pages first -- with a fast counter-based generator: parameters and
// gradients uniform in [-1, 1) and never zero, states at their init values. A serial
// std::normal_distribution fill of llama-1b would take minutes.
class HostWorkloadMemory {
 public:
  HostWorkloadMemory(const Plan& plan, const Workload& w, DType dtype, uint64_t seed);
  ~HostWorkloadMemory();
  HostWorkloadMemory(const HostWorkloadMemory&) = delete;
  HostWorkloadMemory& operator=(const HostWorkloadMemory&) = delete;

  std::vector<TensorRef> refs() const { return refs_; }
  size_t bytes() const;  // all arenas together

 private:
  struct Arena;
  std::vector<std::unique_ptr<Arena>> arenas_;  // per role
  std::vector<TensorRef> refs_;
};

// Fills n elements of `dtype` at p: uniform in [-1, 1) from (seed, index) when `random`, else
// `value`. Parallel over the default thread pool; the result does not depend on the thread count.
void fill_host(void* p, int64_t n, DType dtype, bool random, double value, uint64_t seed);

// The bytes (read + written) one step moves per parameter element: the sum over the plan's
// element phases of reads() + writes(), times the storage size.
int64_t plan_bytes_per_element(const Plan& plan, DType dtype);

}  // namespace optfuse::testing
