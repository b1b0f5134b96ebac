// The CPU dialect's complete source: the shared printer's functions plus one exported loop per
// element phase:
//   extern "C" void of_phase<i>(const OfTensor* tensors, const OfChunk* chunks, long long first,
//       long long last, const double* derived, const double* skip, int derived_per_group,
//       double* partials, long long num_chunks)
// which runs chunks [first, last); partials[k * num_chunks + chunk] gets the chunk's partial of
// the phase's k-th reduction. Loops are plain and restrict-qualified so the compiler vectorises them.
//
// A chunk's partial of a reduction is computed in kCpuReduceLanes independent double lanes:
// element e of the chunk (0-based within the chunk) is accumulated into lane e % kCpuReduceLanes
// (each lane in element order, starting from 0.0), then the lanes are added in order
// 0, 1, ..., kCpuReduceLanes - 1 starting from 0.0 (any-non-finite: 1 if any lane is non-zero).
// The result depends only on the chunk's data, never on the thread count; a sequential sum could
// not be vectorised without reordering its rounding.
#pragma once
#include <string>

#include "optfuse/plan.h"

namespace optfuse {

constexpr int kCpuReduceLanes = 16;

std::string generate_cpu_source(const Plan& plan);

}  // namespace optfuse
