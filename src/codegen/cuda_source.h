// The CUDA dialect's complete source (compiled by NVRTC): the shared printer's functions plus one
// kernel per phase of the plan, `of_phase<i>`: every block evaluates the groups' uniform values,
// walks the chunk list, and the last block to finish combines the phase's partial sums in a fixed
// order (and commits the step after the update phase). One launch per pass over memory.
// See cuda_source.cpp for the exact parameter list (the CUDA executor is its only caller).
#pragma once
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/plan.h"

namespace optfuse {

// With the default variants (every role float32, float16 or bfloat16) or the given ones.
std::string generate_cuda_source(const Plan& plan);
std::string generate_cuda_source(const Plan& plan, const std::vector<StorageVariant>& variants);
std::vector<std::string> cuda_kernel_names(const Plan& plan);
// Threads per block every generated kernel is written for (the deterministic reductions depend on
// it): the executor launches exactly this many.
int cuda_block_threads();
// The start of every kernel of phase i (element passes, the Values step): the step's globals, then
// every group's uniform values into the shared array of_uniform (the kernel declares of_uniform,
// globals and the arguments table, groups, sources, grad_scale, found_inf).
std::string cuda_uniform_prologue(const Plan& plan, size_t phase);
// Dynamic shared memory every kernel needs for `groups` groups (their uniform values and skip flags).
size_t cuda_uniform_shared_bytes(const Plan& plan, int groups);
// Device counters each pass kernel takes (its `done_count` argument), zero before its first launch
// and left zero by its last block: [0] the blocks finished, [1] the chunks handed out past each
// block's first.
int cuda_pass_counters();

}  // namespace optfuse
