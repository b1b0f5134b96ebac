// The CPU dialect's complete source: the shared printer's functions plus one exported loop per
// element phase:
//   extern "C" void of_phase<i>(const OfTensor* tensors, const OfChunk* chunks, long long first,
//       long long last, const double* derived, const double* skip, const double* steps,
//       int derived_per_group, const double* tensor_reductions, int tensor_reductions_per_tensor,
//       double* partials, long long num_chunks)
// which runs chunks [first, last); partials[k * num_chunks + chunk] gets the chunk's partial of
// the phase's k-th reduction. Loops are plain and restrict-qualified so the compiler vectorises them;
// there is one set per storage variant (codegen/abi.h), chosen per tensor by OfTensor::variant.
// Matrix plans have their own loops and entry signature (codegen/cpu_matrix_source.h).
//
// A chunk's partial of a reduction is computed in kCpuReduceLanes independent double lanes:
// element e of the chunk (0-based within the chunk) is accumulated into lane e % kCpuReduceLanes
// (each lane in element order, starting from 0.0), then the lanes are added in order
// 0, 1, ..., kCpuReduceLanes - 1 starting from 0.0 (any-non-finite: 1 if any lane is non-zero).
// The result depends only on the chunk's data, never on the thread count; a sequential sum could
// not be vectorised without reordering its rounding.
#pragma once
#include <string>

#include "codegen/abi.h"
#include "optfuse/plan.h"

namespace optfuse {

constexpr int kCpuReduceLanes = 16;

// With the default variants (every role float32, float16 or bfloat16) or the given ones.
std::string generate_cpu_source(const Plan& plan);
std::string generate_cpu_source(const Plan& plan, const std::vector<StorageVariant>& variants);

}  // namespace optfuse
