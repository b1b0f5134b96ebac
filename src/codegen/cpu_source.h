// The CPU dialect's complete source: the shared printer's functions plus one exported loop per
// element phase:
//   extern "C" void of_phase<i>(const OfTensor* tensors, const OfChunk* chunks, long long first,
//       long long last, const double* derived, const double* skip, int derived_per_group,
//       double* partials, long long num_chunks)
// which runs chunks [first, last); partials[k * num_chunks + chunk] gets the chunk's partial of
// the phase's k-th reduction. Loops are plain and restrict-qualified so the compiler vectorises them.
#pragma once
#include <string>

#include "optfuse/plan.h"

namespace optfuse {

std::string generate_cpu_source(const Plan& plan);

}  // namespace optfuse
