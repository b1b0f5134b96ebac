// Where a matrix plan's row and column data live (plan.h, "Matrix plans"): per tensor, the offset of
// its first row and first column in the row and column tables, of its first column partial and of
// its first matrix; and the host tables themselves. Rows of a matrix plan never straddle chunks,
// nor chunks matrices (build_chunks with whole rows), so a chunk's pass writes its rows' sums
// directly; a column's sums are partials per chunk (C per chunk, at colpart_offset + (chunk within
// the tensor) * C + column), combined in chunk order over the chunks of the column's matrix by the
// Combine step; for chunks of whole small matrices, per matrix (at colpart_offset + matrix * C +
// column). A tensor's columns are per matrix: column c of matrix b is column b * C + c.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "optfuse/optimizer.h"
#include "runtime/chunks.h"

namespace optfuse {

// A tensor's matrix view (TensorRef::cols): rows x cols == numel; without one (is_matrix false) a
// column of numel rows. The rows are `matrices` matrices of matrix_rows rows (TensorRef::matrix_rows).
struct MatrixView {
  int64_t rows = 0, cols = 1;
  int64_t matrix_rows = 0, matrices = 1;
  bool is_matrix = false;
  int64_t columns() const { return matrices * cols; }  // column values: per matrix and column
  // A batch of small matrices (a convolution's 1 x 1, 3 x 3, 7 x 7 kernels): its chunks hold as many
  // whole matrices as a chunk's elements allow (one chunk per matrix would make a chunk per few
  // elements); CUDA steps such a chunk a thread per matrix, and its Values step takes items of
  // kMatricesPerItem matrices, a thread each. Larger matrices: chunks of rows of one.
  bool small_matrices() const;
};
constexpr int64_t kSmallMatrixElements = 256;
constexpr int64_t kMatricesPerItem = 256;  // (OF_THREADS)
MatrixView matrix_view(const TensorRef& t);
// "R x C matrix view" or "batch of B R x C matrices", for error messages.
std::string describe_view(const TensorRef& t);
// Elements a StateShape slot of this tensor holds.
int64_t state_numel(const TensorRef& t, StateShape shape);

struct MatrixLayout {
  // per tensor; view_cols: the view's columns C (column values: matrices x C); chunks_per_matrix:
  // each matrix's chunks (a chunk never spans two matrices)
  std::vector<int64_t> row_offset, col_offset, colpart_offset, first_chunk, matrix_offset, chunks_per_matrix, view_cols;
  int64_t rows = 0, cols = 0, colparts = 0, matrices = 0;  // totals
  int64_t cols_of(size_t t) const { return (t + 1 < col_offset.size() ? col_offset[t + 1] : cols) - col_offset[t]; }  // matrices x C
};
MatrixLayout matrix_layout(const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans);

// The generated loops' per-tensor row of the matrix layout (CUDA's and the CPU's): the generated
// struct OfMatrix (codegen/abi.cpp) matches.
struct DeviceMatrix {
  int64_t cols = 1, is_matrix = 0, row_offset = 0, col_offset = 0, colpart_offset = 0;
  int64_t matrix_rows = 0, chunks_per_matrix = 1, matrix_offset = 0;
  int64_t whole_matrices = 0;  // 1: a batch of small matrices, whole ones in each chunk (MatrixView::small_matrices)
};
static_assert(sizeof(DeviceMatrix) == 72, "DeviceMatrix is shared with generated code (OfMatrix)");
std::vector<DeviceMatrix> device_matrices(const std::vector<TensorRef>& tensors, const MatrixLayout& layout);

// One block's work in the CUDA Values step: a range [begin, begin + count) of a tensor's columns
// (rows == 0) or rows (rows == 1), within one matrix of its view, or (rows == 2, small matrices) of
// its matrices, a thread each. A matrix's items (its column items, then its row items) are
// contiguous. A row item's `first` and `items` span the matrix's row items, a column item's all of
// its items: the last of them to finish sums their sums of row values (and, where a step sums
// column values too, of column values: every item of the matrix) in item order.
// The generated struct OfValueItem matches.
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
  // [matrices][L.tensor_reductions]: each matrix's sums of row and column values (value reductions'
  // slots of the per-tensor area; a tensor value reads its matrix's)
  std::vector<double> matrix_sums;
  size_t sums_per_matrix = 0;
  // where matrix b of tensor t starts in matrix_sums
  size_t sums_at(size_t t, int64_t b) const { return static_cast<size_t>(layout.matrix_offset.at(t) + b) * sums_per_matrix; }
  void build(const Plan& plan, const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans);
};

}  // namespace optfuse
