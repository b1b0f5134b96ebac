// Where a matrix plan's row and column data live (plan.h, "Matrix plans"): per tensor, the offset of
// its first row and first column in the row and column tables and of its first column partial;
// and the host tables themselves. Rows of a matrix plan never straddle chunks (build_chunks with
// whole rows), so a chunk's pass writes its rows' sums directly; a column's sums are partials per
// chunk (C per chunk, at colpart_offset + (chunk within the tensor) * C + column), combined in
// chunk order by the Combine step.
#pragma once
#include <cstdint>
#include <vector>

#include "optfuse/optimizer.h"
#include "runtime/chunks.h"

namespace optfuse {

// A tensor's matrix view (TensorRef::cols): rows x cols == numel.
struct MatrixView {
  int64_t rows = 0, cols = 1;
};
MatrixView matrix_view(const TensorRef& t);
// Elements a StateShape slot of this tensor holds.
int64_t state_numel(const TensorRef& t, StateShape shape);

struct MatrixLayout {
  std::vector<int64_t> row_offset, col_offset, colpart_offset, first_chunk;  // per tensor
  int64_t rows = 0, cols = 0, colparts = 0;                     // totals
};
MatrixLayout matrix_layout(const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans);

// The host executors' tables, [entry][slot] row-major with the plan's per-entry counts.
struct MatrixTables {
  MatrixLayout layout;
  std::vector<double> row_reductions;  // [rows][layout.row_reductions]
  std::vector<double> col_partials;    // [colparts][layout.col_reductions]
  std::vector<double> col_reductions;  // [cols][layout.col_reductions]
  std::vector<double> row_values;      // [rows][layout.row_values]: float32 math, kept as double
  std::vector<double> col_values;      // [cols][layout.col_values]
  void build(const Plan& plan, const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans);
};

}  // namespace optfuse
