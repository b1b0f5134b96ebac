#include "runtime/matrix_tables.h"

#include "optfuse/error.h"

namespace optfuse {

MatrixView matrix_view(const TensorRef& t) {
  MatrixView v;
  v.cols = t.cols > 0 ? t.cols : 1;
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
