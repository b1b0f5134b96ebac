// The CUDA driver's parts for matrix plans (plan.h, "Matrix plans": row and column values,
// Adafactor), used by cuda_source.cpp:
//   - a chunk loop per phase and storage variant, `of_phase<i>_v<k>_mchunk`: a chunk is whole rows
//     (at most OF_MROWS of them where the view has more than one column); threads take columns,
//     a row's sum is a shuffle tree per warp then the warps in order (shared memory), a column's
//     sum over the chunk's rows is each thread's own (one partial per chunk and column); a
//     one-column view (a vector) takes a thread per row instead. Element code reads the row's and
//     column's values as u[D + TV + k] / u[D + TV + RV + k]. After the update pass, the chunk
//     writes its rows' Rows states and, the tensor's first chunk, its Cols states (the Commit step)
//     from the value tables, unless the group skipped.
//   - the Values step before pass i, `of_values<i>`: a block per OfValueItem (a range of one
//     tensor's columns; the tensor's first also its rows) combines the column partials of the pass
//     just run in chunk order, then evaluates the row and column values (of_phase<i>_rows / _cols)
//     into the value tables and, for rows, the per-tensor sums of row values (a fixed block tree).
// All reductions are in a fixed order: bitwise the same every run.
#pragma once
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/plan.h"

namespace optfuse {

// The roles (0 param, 1 grad, 2 + s state s) an element phase reads and writes.
struct CudaPhaseRoles {
  std::vector<int> reads, writes, used;
  bool read_only(int r) const;
};
CudaPhaseRoles cuda_phase_roles(const ElementPhase& ph);

// Rows per chunk of a matrix view of more than one column (OF_MROWS), and elements per chunk.
int32_t cuda_matrix_chunk_rows();
int32_t cuda_matrix_chunk_elements();
// Columns per Values-step block (OfValueItem).
int32_t cuda_value_item_cols();

// Structs and constants (after the ABI and the driver prelude).
std::string cuda_matrix_prelude(const Plan& plan);
std::string cuda_matrix_chunk_function(const Plan& plan, size_t phase, size_t variant, const StorageVariant& var);
std::string cuda_values_kernel(const Plan& plan, size_t phase, const std::vector<StorageVariant>& variants);

}  // namespace optfuse
