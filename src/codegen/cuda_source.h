// The CUDA dialect's complete source (compiled by NVRTC): the shared printer's functions plus, per
// phase i of the plan, a scalar kernel and an element kernel:
//   extern "C" __global__ void of_scalar_phase<i>(...)   one block: combines the partial sums of
//       finished reductions in a fixed order, then evaluates each group's uniform values
//   extern "C" __global__ void of_phase<i>(...)          all tensors: blocks walk the chunk list
// See cuda_source.cpp for the exact parameter lists (the CUDA executor is their only caller).
#pragma once
#include <string>
#include <vector>

#include "optfuse/plan.h"

namespace optfuse {

std::string generate_cuda_source(const Plan& plan);
std::vector<std::string> cuda_kernel_names(const Plan& plan);
// Threads per block every generated kernel is written for (the deterministic reductions depend on
// it): the executor launches exactly this many.
int cuda_block_threads();

}  // namespace optfuse
