// The CPU driver's loops for matrix plans (plans with row or column values or reductions,
// Plan::matrix()). A chunk holds whole rows of its tensor's matrix view (build_chunks with whole
// rows), so a thread walks its chunk row by row: a row's sums are complete at the row's end (in
// element order), a column's sums are the chunk's partials (rows in order), per-tensor and global
// sums one running sum per chunk (elements in order). Every order is fixed by the chunk alone:
// results do not depend on the thread count. The Values step is generated too (of_values<i>, per
// matrix: its tensor values, rows, columns, sums; matrices split across threads); the Commit step
// stays in the host interpreter (commit_matrix_states): it copies values into states.
//
// extern "C" void of_phase<i>(tensors, chunks, first, last, derived, skip, steps, derived_per_group,
//     tensor_reductions, tensor_reductions_per_tensor, partials, num_chunks, const OfMatrix* m,
//     double* row_red, double* col_part, const double* row_val, const double* col_val)
// reads and writes the host MatrixTables (runtime/matrix_tables.h) through those pointers; `m` is
// the per-tensor DeviceMatrix list.
// extern "C" void of_values<i>(tensors, m, num_tensors, total_matrices, k0, k1, derived,
//     derived_per_group, tensor_reductions, tensor_reductions_per_tensor, const double* row_red,
//     const double* col_red, double* row_val, double* col_val, double* matrix_sums)
// is the Values step before pass i over matrices [k0, k1) (matrix numbers: MatrixLayout::matrix_offset).
#pragma once
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/plan.h"

namespace optfuse {

// Phase i's chunk function for storage variant k, its extern "C" entry and its Values step (after
// common_source()).
std::string cpu_matrix_phase_source(const Plan& plan, size_t i, const std::vector<StorageVariant>& variants);

}  // namespace optfuse
