#include "runtime/matrix_tables.h"

#include <algorithm>

#include "optfuse/error.h"

namespace optfuse {

MatrixView matrix_view(const TensorRef& t) {
  MatrixView v;
  v.is_matrix = t.cols > 0;
  v.cols = v.is_matrix ? t.cols : 1;
  v.rows = t.param.numel / v.cols;
  return v;
}

int64_t state_numel(const TensorRef& t, StateShape shape) {
  switch (shape) {
    case StateShape::Full: return t.param.numel;
    case StateShape::Rows: return matrix_view(t).rows;
    case StateShape::Cols: return matrix_view(t).cols;
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
    m.rows += v.rows;
    m.cols += v.cols;
    m.colparts += static_cast<int64_t>(spans.at(t).count) * v.cols;
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
  }
  return out;
}

std::vector<ValueItem> value_items(const std::vector<TensorRef>& tensors, int32_t cols_per_item, int32_t rows_per_item) {
  std::vector<ValueItem> items;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].param.numel == 0) continue;
    const MatrixView v = matrix_view(tensors[t]);
    const int32_t tensor = static_cast<int32_t>(t);
    for (int64_t c = 0; c < v.cols; c += cols_per_item)
      items.push_back({tensor, static_cast<int32_t>(c), static_cast<int32_t>(std::min<int64_t>(cols_per_item, v.cols - c)), 0, 0, 0});
    const int32_t first = static_cast<int32_t>(items.size());
    const int32_t n = static_cast<int32_t>((v.rows + rows_per_item - 1) / rows_per_item);
    for (int64_t r = 0; r < v.rows; r += rows_per_item)
      items.push_back({tensor, static_cast<int32_t>(r), static_cast<int32_t>(std::min<int64_t>(rows_per_item, v.rows - r)), 1, first, n});
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
}

}  // namespace optfuse
