// The CUDA driver's parts for matrix plans (plan.h, "Matrix plans": row and column values,
// Adafactor), used by cuda_source.cpp:
//   - a chunk loop per phase and storage variant, `of_phase<i>_v<k>_mchunk`: a chunk is whole rows
//     (at most OF_MROWS of them where the view has more than one column); threads take columns,
//     a row's sum is a shuffle tree per warp then the warps in order (shared memory), a column's
//     sum over the chunk's rows is each thread's own (one partial per chunk and column); a
//     one-column view (a vector) takes a thread per row instead. Element code reads the row's and
//     column's values as u[D + TV + k] / u[D + TV + RV + k]. Passes without row or column
//     reductions run the vector loop of cuda_source.cpp instead, reading each element's row and
//     column values.
//   - the Commit step, `of_phase<i>_v<k>_commit`: after a chunk of the update pass, its rows' Rows
//     states and, the tensor's first chunk, its Cols states from the value tables (a skipped
//     group's chunks never run).
//   - the Values step before pass i, `of_values<i>`: a block per OfValueItem, 32 columns or 2048
//     rows of one tensor. A column item combines the column partials of the pass just run (8 warps
//     over the chunks, then in warp order) and evaluates the column values (of_phase<i>_cols); a
//     row item evaluates row values (of_phase<i>_rows) and its share of the per-tensor sums of row
//     values (a fixed block tree), which the tensor's last row item to finish adds in item order.
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
// Columns and rows per Values-step block (OfValueItem).
int32_t cuda_value_item_cols();
int32_t cuda_value_item_rows();

// Structs and constants (after the ABI and the driver prelude).
std::string cuda_matrix_prelude();
std::string cuda_matrix_chunk_function(const Plan& plan, size_t phase, size_t variant, const StorageVariant& var);
std::string cuda_matrix_commit_function(const Plan& plan, size_t phase, size_t variant, const StorageVariant& var);
std::string cuda_values_kernel(const Plan& plan, size_t phase, const std::vector<StorageVariant>& variants);

}  // namespace optfuse
