// The one C-like printer. Both backends' sources are C++: the CPU dialect is compiled by the host
// compiler, the CUDA dialect by NVRTC. They share everything that computes (the element math of
// each phase, the float64 scalar math, the helpers in the common prelude) and differ only in a small
// Dialect table and in the driver loops that walk the tensor table (cpu_source.cpp, cuda_source.cpp).
//
// Contract with the drivers, for phase i of the plan:
//   OF_FN void of_phase<i>_element(float* v, const float* u, double* acc)
//   OF_FN void of_phase<i>_element_f64(double* v, const double* u, double* acc)
//     (the _f64 forms, also of the tensor and row/column functions below, only in sources with a
//     variant that computes in float64, variant_computes_f64: the same math in double, uniform
//     and tensor values unrounded)
//     v[role] holds the loaded values of the roles the phase reads (role 0 param, 1 grad, 2+s state
//     s, see ElementPhase::reads_*); on return v[role] holds the new values of the roles it writes.
//     u[d] holds derived uniform slot d rounded to float, then (from u[D], D = the plan's derived
//     count) the tensor's values. Reduce phases add into acc[k] for the k-th reduction of the phase
//     (sum of squares: += x*x in double; any-non-finite: = 1), whatever its scope.
//   OF_FN void of_phase<i>_tensor(const double* derived, const double* reductions, float* u)
//     (only when the plan has tensor values) one tensor's values for this phase, from its group's
//     derived row and its row of per-tensor reductions, into u[k] = element u[D + k]. A matrix plan's
//     takes `const double* shape` (numel, rows, cols, is_matrix) before u.
//   OF_FN void of_phase<i>_rows(const float* u, const float* st, const double* red, float* out, double* sums)
//   OF_FN void of_phase<i>_cols(...)
//     (matrix plans) the Values step for one row / column: its values of the levels phase i may
//     read (out[k] = u[D + TV + k] of the element function for rows, u[D + TV + RV + k] for
//     columns) from u (derived and tensor values), its old Rows / Cols states st[s] and its
//     reductions red[k]; sums[slot] += its share of each per-tensor sum of row / column values.
//   OF_FN void of_phase<i>_scalars(const double* hyper, double steps, const double* globals,
//                                  const double* reductions, double* derived, double* skip, double* steps_out)
//     one group's uniform values for this phase; hyper points at the group's row. The update
//     phase's version also writes *skip and, when not skipping, *steps_out = steps + 1.
#pragma once
#include <string>
#include <vector>

#include "optfuse/plan.h"

namespace optfuse {

struct Dialect {
  const char* name;          // "cpu" | "cuda"
  const char* fn_qualifier;  // qualifier of helper and element functions
  const char* is_finite;     // expression template for a float finiteness test: "%s"
  // Expression template for float (element) 1/sqrt(x). CUDA's rsqrtf is one special-function
  // instruction (at most 2 ulp, what torch's CUDA rsqrt computes); the correctly rounded
  // 1.0f / sqrtf(x) costs two IEEE sequences, which made Adafactor's element passes arithmetic-bound.
  const char* rsqrt_float;
  const char* extra_prelude; // dialect-only helpers (e.g. bf16 conversions through intrinsics)
};

const Dialect& cpu_dialect();
const Dialect& cuda_dialect();
// OF_FN, the dialect's own helpers and the shared ones (min/max with NaN, lerp, bf16/f16
// conversions...): what any source in the dialect may build on, plan or not (the matrix phase's
// kernels use it too).
std::string dialect_prelude(const Dialect& d);

// Phase i's element function: of_phase<i>_element, or of_phase<i>_element_recomputing for the
// form run by tensors whose states written ahead are not float32 (Plan::recomputing); with the
// suffix _f64 for the float64 math of a variant that computes in float64.
std::string element_function_name(const Plan& plan, size_t phase, bool states_ahead = true, bool f64 = false);
// "_f64" or "": the suffix of the float64 forms of the printer's functions.
inline const char* f64_suffix(bool f64) { return f64 ? "_f64" : ""; }

class CPrinter {
 public:
  CPrinter(const Plan& plan, const Dialect& dialect);
  // "// optfuse generated source ..." naming the chain, the backend and the phases.
  std::string header_comment() const;
  // Shared helpers: lerp, min/max with NaN, sign, bf16/f16 conversions, OF_FN.
  std::string prelude() const;
  // f64: the float64 forms (of_phase<i>_element_f64, ...) instead of the float32 ones.
  std::string element_function(size_t phase, bool f64 = false) const;
  std::string scalar_function(size_t phase) const;
  std::string tensor_function(size_t phase, bool f64 = false) const;
  // (matrix plans) of_phase<i>_tensor_matrix, same arguments: only the tensor values that read the
  // matrix's sums of row or column values (and what they are computed from), for a loop entering a
  // further matrix of a tensor whose other values it has; "" when no value reads the sums.
  std::string per_matrix_tensor_function(size_t phase, bool f64 = false) const;
  // The Values step's function for one row (cols false) or one column of a matrix plan.
  std::string line_function(size_t phase, bool cols, bool f64 = false) const;
  // Everything above for every phase, in order: what a driver puts before its loops; with f64 also
  // the float64 forms (a source with a variant that computes in float64).
  std::string common_source(bool f64 = false) const;
  int num_roles() const { return 2 + plan_.num_states(); }
  const Plan& plan() const { return plan_; }

 private:
  std::string tensor_values_function(size_t phase, bool per_matrix_only, bool f64) const;
  std::string element_function(size_t phase, bool states_ahead, bool f64) const;
  std::string value_name(NodeId id) const;
  std::string expr(NodeId id, bool element) const;
  const Plan& plan_;
  const Dialect& d_;
  std::vector<std::string> names_;  // unique C identifier per node
};

// A number as a C literal: float (element math) or double, inf and NaN by the prelude's macros.
std::string c_literal(double v, bool element);

// Role names for comments and for drivers: "param", "grad", then state names.
std::vector<std::string> role_names(const Plan& plan);

}  // namespace optfuse
