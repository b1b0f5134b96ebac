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

// A tensor's matrix view (TensorRef::cols): rows x cols == numel; without one (is_matrix false) a
// column of numel rows.
struct MatrixView {
  int64_t rows = 0, cols = 1;
  bool is_matrix = false;
};
MatrixView matrix_view(const TensorRef& t);
// Elements a StateShape slot of this tensor holds.
int64_t state_numel(const TensorRef& t, StateShape shape);

struct MatrixLayout {
  std::vector<int64_t> row_offset, col_offset, colpart_offset, first_chunk;  // per tensor
  int64_t rows = 0, cols = 0, colparts = 0;                     // totals
  int64_t cols_of(size_t t) const { return (t + 1 < col_offset.size() ? col_offset[t + 1] : cols) - col_offset[t]; }
};
MatrixLayout matrix_layout(const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans);

// The generated loops' per-tensor row of the matrix layout (CUDA's and the CPU's): the generated
// struct OfMatrix (codegen/abi.cpp) matches.
struct DeviceMatrix {
  int64_t cols = 1, is_matrix = 0, row_offset = 0, col_offset = 0, colpart_offset = 0;
};
static_assert(sizeof(DeviceMatrix) == 40, "DeviceMatrix is shared with generated code (OfMatrix)");
std::vector<DeviceMatrix> device_matrices(const std::vector<TensorRef>& tensors, const MatrixLayout& layout);

// One block's work in the CUDA Values step: a range [begin, begin + count) of a tensor's columns
// (rows == 0) or rows (rows == 1). A tensor's row items are contiguous, `first` the index of its
// first and `items` their number: the last of them to finish sums their per-tensor sums of row values
// in item order. The generated struct OfValueItem matches.
struct ValueItem {
  int32_t tensor = 0, begin = 0, count = 0, rows = 0, first = 0, items = 0;
};
static_assert(sizeof(ValueItem) == 24, "ValueItem is shared with generated code (OfValueItem)");
std::vector<ValueItem> value_items(const std::vector<TensorRef>& tensors, int32_t cols_per_item, int32_t rows_per_item);

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
