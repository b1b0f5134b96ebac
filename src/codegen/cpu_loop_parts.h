// Pieces of the CPU driver shared by its vector loops (cpu_source.cpp) and its matrix loops
// (cpu_matrix_source.cpp): storage types, the roles a phase reads and writes, one element's loads,
// element function call and stores.
#pragma once
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/plan.h"

namespace optfuse::cpu_loops {

// The C type a role of this dtype is stored as in the CPU source ("float", "of_bfloat", ...).
const char* storage_type(DType d);

struct PhaseRoles {
  std::vector<int> read, write, used;  // role indices (0 param, 1 grad, 2+s state s)
};
PhaseRoles phase_roles(const ElementPhase& ph);

// Whether a phase stores some role of variant v stochastically (it then needs the random stream).
bool phase_rounds_stochastically(const PhaseRoles& pr, const StorageVariant& v);

// One element at index `idx`: load the roles the phase reads, run the element function `fn`
// (element_function_name) with accumulators `acc`, store the roles it writes (stochastic stores
// draw bits for element first_elem + idx of the tensor). Values are float, or double where the
// variant computes in float64 (variant_computes_f64; fn is then the _f64 form).
std::string element_body(const std::string& fn, const PhaseRoles& pr, const StorageVariant& var,
                         const std::vector<std::string>& roles, const std::string& idx, const std::string& acc,
                         const std::string& indent);
// "double" where the variant computes in float64, else "float".
inline const char* compute_type(const StorageVariant& v) { return variant_computes_f64(v) ? "double" : "float"; }

}  // namespace optfuse::cpu_loops
