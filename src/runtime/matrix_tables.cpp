#include "runtime/matrix_tables.h"

#include <algorithm>

#include "optfuse/error.h"

namespace optfuse {

MatrixView matrix_view(const TensorRef& t) {
  MatrixView v;
  v.is_matrix = t.cols > 0;
  v.cols = v.is_matrix ? t.cols : 1;
  v.rows = t.param.numel / v.cols;
  v.matrix_rows = t.matrix_rows > 0 && v.is_matrix ? t.matrix_rows : v.rows;
  v.matrices = v.matrix_rows > 0 ? v.rows / v.matrix_rows : 1;
  return v;
}

bool MatrixView::small_matrices() const { return matrices > 1 && matrix_rows * cols <= kSmallMatrixElements; }

std::string describe_view(const TensorRef& t) {
  const MatrixView v = matrix_view(t);
  const std::string m = std::to_string(v.matrix_rows) + " x " + std::to_string(v.cols);
  return v.matrices == 1 ? m + " matrix view" : "view as a batch of " + std::to_string(v.matrices) + " " + m + " matrices";
}

int64_t state_numel(const TensorRef& t, StateShape shape) {
  switch (shape) {
    case StateShape::Full: return t.param.numel;
    case StateShape::Rows: return matrix_view(t).rows;
    case StateShape::Cols: return matrix_view(t).columns();
  }
  return t.param.numel;
}

MatrixLayout matrix_layout(const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans) {
  MatrixLayout m;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const MatrixView v = matrix_view(tensors[t]);
    m.row_offset.push_back(m.rows);
    m.col_offset.push_back(m.cols);
    m.colpart_offset.push_back(m.colparts);
    m.first_chunk.push_back(spans.at(t).first);
    m.matrix_offset.push_back(m.matrices);
    m.view_cols.push_back(v.cols);
    // chunks of whole small matrices: one chunk per matrix as far as its partials go
    const int64_t per = v.small_matrices() ? 1 : std::max<int64_t>(1, static_cast<int64_t>(spans.at(t).count) / std::max<int64_t>(1, v.matrices));
    m.chunks_per_matrix.push_back(per);
    m.rows += v.rows;
    m.cols += v.columns();
    m.colparts += v.matrices * per * v.cols;
    m.matrices += v.matrices;
  }
  return m;
}

std::vector<DeviceMatrix> device_matrices(const std::vector<TensorRef>& tensors, const MatrixLayout& layout) {
  std::vector<DeviceMatrix> out(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const MatrixView v = matrix_view(tensors[t]);
    out[t].cols = v.cols;
    out[t].is_matrix = v.is_matrix ? 1 : 0;
    out[t].row_offset = layout.row_offset[t];
    out[t].col_offset = layout.col_offset[t];
    out[t].colpart_offset = layout.colpart_offset[t];
    out[t].matrix_rows = v.matrix_rows;
    out[t].chunks_per_matrix = layout.chunks_per_matrix[t];
    out[t].matrix_offset = layout.matrix_offset[t];
    out[t].whole_matrices = v.small_matrices() ? 1 : 0;
  }
  return out;
}

std::vector<ValueItem> value_items(const std::vector<TensorRef>& tensors, int32_t cols_per_item, int32_t rows_per_item) {
  std::vector<ValueItem> items;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].param.numel == 0) continue;
    const MatrixView v = matrix_view(tensors[t]);
    const int32_t tensor = static_cast<int32_t>(t);
    auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
    if (v.small_matrices()) {  // whole matrices, a thread each
      for (int64_t b = 0; b < v.matrices; b += kMatricesPerItem)
        items.push_back({tensor, i32(b), i32(std::min<int64_t>(kMatricesPerItem, v.matrices - b)), 2, 0, 0});
      continue;
    }
    for (int64_t b = 0; b < v.matrices; ++b) {  // items never span two matrices: its column items, then its row items
      const int32_t first = static_cast<int32_t>(items.size());
      const int32_t ncols = i32((v.cols + cols_per_item - 1) / cols_per_item);
      const int32_t nrows = i32((v.matrix_rows + rows_per_item - 1) / rows_per_item);
      for (int64_t c = 0; c < v.cols; c += cols_per_item)
        items.push_back({tensor, i32(b * v.cols + c), i32(std::min<int64_t>(cols_per_item, v.cols - c)), 0, first, ncols + nrows});
      for (int64_t r = 0; r < v.matrix_rows; r += rows_per_item)
        items.push_back({tensor, i32(b * v.matrix_rows + r), i32(std::min<int64_t>(rows_per_item, v.matrix_rows - r)), 1,
                         first + ncols, nrows});
    }
  }
  return items;
}

void MatrixTables::build(const Plan& plan, const std::vector<TensorRef>& tensors, const std::vector<ChunkRange>& spans) {
  const ScalarLayout& L = plan.layout;
  layout = matrix_layout(tensors, spans);
  auto n = [](int64_t entries, int per) { return static_cast<size_t>(entries) * static_cast<size_t>(per); };
  row_reductions.assign(n(layout.rows, L.row_reductions), 0.0);
  col_partials.assign(n(layout.colparts, L.col_reductions), 0.0);
  col_reductions.assign(n(layout.cols, L.col_reductions), 0.0);
  row_values.assign(n(layout.rows, L.row_values), 0.0);
  col_values.assign(n(layout.cols, L.col_values), 0.0);
  sums_per_matrix = static_cast<size_t>(L.tensor_reductions);
  matrix_sums.assign(n(layout.matrices, L.tensor_reductions), 0.0);
}

}  // namespace optfuse
