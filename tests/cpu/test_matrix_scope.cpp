// Row and column reductions and states (matrix plans), against values derived by hand on the
// reference evaluator and the CPU backend: each row and column of each tensor's matrix view sees
// its own elements only (also across chunks: a column's partials are combined in chunk order),
// a tensor without a view is one column of numel rows, per-tensor sums of row values, the Commit
// step (states change only on steps that are not skipped), Adafactor's plan and planning errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "runtime/chunks.h"
#include "runtime/matrix_tables.h"
#include "testing/matrix_rules.h"
#include "testing/scoped_env.h"
#include "testing/tensor_set.h"

namespace optfuse {
namespace {

// rows <- row sums of g^2, cols <- column sums of g^2; the update is (rows_i + cols_j) * mean_i(rows_i)
// * -lr: row, column and element values and a per-tensor sum of row values in one chain.
Chain row_and_column_sums() {
  Rule r("row_and_column_sums");
  r.hyper("lr", 0.5).row_state("rows").col_state("cols");
  r.update([](RuleBuilder& b) {
    Expr g = b.update();
    Expr rows = row_sum_of_squares(g), cols = col_sum_of_squares(g);
    b.set_state("rows", rows);
    b.set_state("cols", cols);
    Expr row_mean = tensor_sum(rows) / b.shape(ShapeItem::Rows);
    return (rows + cols) * row_mean * -b.hyper("lr");
  });
  return {r};
}

Chain sum_of_columns() { return {testing::sum_of_columns()}; }

struct Matrix {
  int64_t rows, cols;  // cols 0: no matrix view (a column of rows elements)
  std::vector<float> p, g, row_state, col_state;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c) {
    const int64_t n = r * (c > 0 ? c : 1);
    p.assign(static_cast<size_t>(n), 1.0f);
    for (int64_t i = 0; i < n; ++i) g.push_back(static_cast<float>((i * 7919 % 23) - 11) / 8.0f);
    row_state.assign(static_cast<size_t>(r), -1.0f);
    col_state.assign(static_cast<size_t>(c > 0 ? c : 1), -1.0f);
  }
  int64_t numel() const { return static_cast<int64_t>(p.size()); }
  TensorRef ref() {
    TensorRef t;
    t.param = {p.data(), numel(), DType::f32};
    t.grad = {g.data(), numel(), DType::f32};
    t.states = {{row_state.data(), rows, DType::f32}, {col_state.data(), static_cast<int64_t>(col_state.size()), DType::f32}};
    t.cols = cols;
    return t;
  }
  double grad(int64_t i, int64_t j) const { return g[static_cast<size_t>(i * (cols > 0 ? cols : 1) + j)]; }
};

class MatrixScope : public ::testing::TestWithParam<Backend> {};

TEST_P(MatrixScope, EachRowAndColumnSeesOnlyItsOwnElements) {
  // A 3 x 5 matrix, a 300 x 301 one (several chunks on every backend: column partials combined
  // across chunks), a vector of 7 (no view: 7 rows of one column) and an empty tensor.
  std::vector<Matrix> ms = {Matrix(3, 5), Matrix(300, 301), Matrix(7, 0), Matrix(0, 4)};
  std::vector<TensorRef> refs;
  for (Matrix& m : ms) refs.push_back(m.ref());
  Optimizer opt(row_and_column_sums(), GetParam());
  opt.set_tensors(refs);
  opt.step();
  for (size_t k = 0; k < ms.size(); ++k) {
    const Matrix& m = ms[k];
    const int64_t C = m.cols > 0 ? m.cols : 1;
    std::vector<double> row(static_cast<size_t>(m.rows), 0.0), col(static_cast<size_t>(C), 0.0);
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < C; ++j) {
        row[static_cast<size_t>(i)] += m.grad(i, j) * m.grad(i, j);
        col[static_cast<size_t>(j)] += m.grad(i, j) * m.grad(i, j);
      }
    double mean = 0;
    for (double r : row) mean += static_cast<double>(static_cast<float>(r));
    mean /= static_cast<double>(std::max<int64_t>(m.rows, 1));
    for (int64_t i = 0; i < m.rows; ++i) EXPECT_NEAR(m.row_state[static_cast<size_t>(i)], row[static_cast<size_t>(i)], 1e-4) << k;
    if (m.rows > 0)
      for (int64_t j = 0; j < C; ++j) EXPECT_NEAR(m.col_state[static_cast<size_t>(j)], col[static_cast<size_t>(j)], 1e-3) << k;
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < C; ++j) {
        double want = 1.0 - 0.5 * (row[static_cast<size_t>(i)] + col[static_cast<size_t>(j)]) * mean;
        ASSERT_NEAR(m.p[static_cast<size_t>(i * C + j)], want, 1e-6 * std::max(1.0, std::fabs(want))) << k << " " << i << "," << j;
      }
  }
}

TEST_P(MatrixScope, RowAndColumnStatesChangeOnlyOnStepsThatAreNotSkipped) {
  Matrix m(4, 3);
  Optimizer opt(chain({make_builtin("unscale_by_grad_scale"), row_and_column_sums()}), GetParam());
  opt.set_tensors({m.ref()});
  const float one = 1.0f, inf_found = 1.0f;
  StepInputs in;
  in.grad_scale = &one;
  in.found_inf = &inf_found;
  opt.step(in);
  for (float v : m.row_state) EXPECT_EQ(v, -1.0f);
  for (float v : m.col_state) EXPECT_EQ(v, -1.0f);
  for (float v : m.p) EXPECT_EQ(v, 1.0f);
  EXPECT_EQ(opt.step_count(0), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, MatrixScope, ::testing::Values(Backend::reference, Backend::cpu),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(MatrixScope, AdafactorOnTheCpuMatchesTheReference) {
  // Matrices of one and several chunks, a row longer than a chunk, vectors (no view), two groups;
  // 10 steps with new gradients each. The CPU backend runs the plan in float32 (its generated
  // loops), the reference in float64.
  const std::vector<testing::TensorSpec> sizes = {{300 * 1001, 0, 1001}, {65537, 1, 0}, {3, 0, 3}, {2 * 20000, 1, 20000},
                                                  {17 * 5, 1, 5}, {1, 0, 0}, {3 * 300 * 301, 1, 301, 300}};
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(d));
    Chain c = adafactor({{"lr", 0.05}, {"weight_decay", 0.1}});
    Optimizer ref(c, Backend::reference, 2), cpu(c, Backend::cpu, 2);
    EXPECT_NE(cpu.backend_status().find("compiled"), std::string::npos) << cpu.backend_status();
    for (Optimizer* o : {&ref, &cpu}) o->set_hyper(1, "lr", 0.02);
    testing::HostTensorSet rs(ref.plan(), sizes, d, 7), cs(cpu.plan(), sizes, d, 7), fresh(ref.plan(), sizes, d, 7);
    ref.set_tensors(rs.refs());
    cpu.set_tensors(cs.refs());
    for (int s = 1; s <= 10; ++s) {
      rs.randomize_grads(100 + static_cast<uint64_t>(s));
      cs.randomize_grads(100 + static_cast<uint64_t>(s));
      ref.step();
      cpu.step();
      ASSERT_LE(testing::max_relative_difference(cs, rs), d == DType::f32 ? 2e-6 : 1.0 / 128) << "step " << s;
    }
    EXPECT_GT(testing::max_relative_difference(fresh, rs), 1e-3);  // it moved
    EXPECT_EQ(cpu.step_count(1), 10);
  }
}

TEST(MatrixScope, ChunksHoldWholeRows) {
  std::vector<float> data(100);
  std::vector<TensorRef> ts(3);
  ts[0].param = {data.data(), 30, DType::f32};  // 3 x 10 with 16-element chunks: one row per chunk
  ts[0].cols = 10;
  ts[1].param = {data.data(), 40, DType::f32};  // a row of 40 is longer than a chunk: a chunk of its own
  ts[1].cols = 40;
  ts[2].param = {data.data(), 20, DType::f32};  // no view: 16 + 4
  std::vector<Chunk> chunks = build_chunks(ts, 16, true);
  ASSERT_EQ(chunks.size(), 6u);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(chunks[static_cast<size_t>(c)].length, 10);
  EXPECT_EQ(chunks[3].length, 40);
  EXPECT_EQ(chunks[4].length, 16);
  EXPECT_EQ(chunks[5].length, 4);
  MatrixLayout ml = matrix_layout(ts, chunk_ranges(ts.size(), chunks));
  EXPECT_EQ(ml.rows, 3 + 1 + 20);
  EXPECT_EQ(ml.cols, 10 + 40 + 1);
  EXPECT_EQ(ml.colparts, 3 * 10 + 40 + 2);
  EXPECT_EQ(ml.colpart_offset[2], 70);
  EXPECT_EQ(ml.first_chunk[2], 4);
}

TEST(MatrixScope, AdafactorIsThreePassesOf24BytesPerElement) {
  Plan plan = make_plan(adafactor({{"weight_decay", 0.01}}));
  ASSERT_EQ(plan.phases.size(), 3u);
  int bytes = 0;
  for (const ElementPhase& ph : plan.phases) bytes += 4 * (ph.reads() + ph.writes());
  EXPECT_EQ(bytes, 24);  // ||p||, row and column means of g^2: 8; ||update||: 4; the update: 12
  EXPECT_TRUE(plan.matrix());
  EXPECT_EQ(plan.layout.row_reductions, 1);
  EXPECT_EQ(plan.layout.col_reductions, 1);
  EXPECT_NE(plan.describe().find("values 2:"), std::string::npos);
  EXPECT_NE(plan.describe().find("commit 2:"), std::string::npos);
}

TEST(MatrixScope, StateSizesAndViewsAreChecked) {
  Matrix m(4, 3);
  Optimizer opt(row_and_column_sums(), Backend::reference);
  TensorRef bad = m.ref();
  bad.states[1].numel = 4;
  EXPECT_THROW(opt.set_tensors({bad}), Error);
  bad = m.ref();
  bad.cols = 5;  // does not divide 12
  EXPECT_THROW(opt.set_tensors({bad}), Error);
  opt.set_tensors({m.ref()});
  EXPECT_THROW(opt.set_exchange({1, {{0, 1}}}, [](const PartialSums&) {}), Error);
}

TEST(MatrixScope, PlanningErrors) {
  // a row state given a per-element value
  Rule r("bad_row_state");
  r.row_state("rows").update([](RuleBuilder& b) {
    b.set_state("rows", b.update());
    return b.update();
  });
  EXPECT_THROW(make_plan(Chain{r}), Error);
  // a row value that reads a per-tensor sum of row values
  Rule s("row_reads_its_sum");
  s.row_state("rows").update([](RuleBuilder& b) {
    Expr rows = row_sum_of_squares(b.update());
    b.set_state("rows", rows / tensor_sum(rows));
    return b.update();
  });
  EXPECT_THROW(make_plan(Chain{s}), Error);
  // a global sum of row values
  Rule t("global_sum_of_rows");
  t.row_state("rows").update([](RuleBuilder& b) { return b.update() * reduce(Op::Sum, b.state("rows"), Scope::Global); });
  EXPECT_THROW(make_plan(Chain{t}), Error);
}

TEST_P(MatrixScope, MaxOfAbsPerRowAndColumn) {
  // rows <- max |g| of each row, cols <- of each column, on a 3 x 4 matrix.
  Rule r("row_and_column_max");
  r.row_state("rows").col_state("cols").update([](RuleBuilder& b) {
    b.set_state("rows", reduce(Op::MaxAbs, b.update(), Scope::Row));
    b.set_state("cols", reduce(Op::MaxAbs, b.update(), Scope::Col));
    return b.update() * 0.0;
  });
  Matrix m(3, 4);
  Optimizer opt(Chain{r}, GetParam());
  opt.set_tensors({m.ref()});
  opt.step();
  for (int64_t i = 0; i < 3; ++i) {
    double want = 0;
    for (int64_t j = 0; j < 4; ++j) want = std::max(want, std::fabs(m.grad(i, j)));
    EXPECT_EQ(m.row_state[static_cast<size_t>(i)], static_cast<float>(want)) << i;
  }
  for (int64_t j = 0; j < 4; ++j) {
    double want = 0;
    for (int64_t i = 0; i < 3; ++i) want = std::max(want, std::fabs(m.grad(i, j)));
    EXPECT_EQ(m.col_state[static_cast<size_t>(j)], static_cast<float>(want)) << j;
  }
}

// The CPU backend's generated matrix loops and Values steps and its float32 interpreter (no
// compiler) take every sum in the same order (rows, columns and chunks in order), so they agree
// bitwise: row and column sums, maxima of abs, per-tensor sums of row values and of column values,
// Adafactor; float32 and bfloat16 storage; single matrices and batches of large and of small ones.
TEST(MatrixScope, CpuLoopsEqualTheInterpreterBitwise) {
  const std::vector<testing::TensorSpec> sizes = {{300 * 1001, 0, 1001}, {65537, 1, 0}, {3, 0, 3}, {2 * 20000, 1, 20000},
                                                  {17 * 5, 1, 5}, {1, 0, 0}, {3 * 300 * 301, 1, 301, 300},
                                                  {2000 * 3 * 3, 0, 3, 3}, {700, 1, 1, 1}, {50 * 4 * 7, 0, 7, 4}};
  for (const Chain& c : {adafactor({{"lr", 0.05}, {"weight_decay", 0.1}}), row_and_column_sums(), sum_of_columns(),
                         Chain{testing::row_and_column_max()}, Chain{testing::row_and_column_value_sums()}})
    for (DType d : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(build_program(c).chain_text) + ", " + dtype_name(d));
      Optimizer compiled(c, Backend::cpu, 2);
      std::unique_ptr<Optimizer> interpreted;
      {
        testing::ScopedEnv none("OPTFUSE_CXX", "none");
        interpreted = std::make_unique<Optimizer>(c, Backend::cpu, 2);
      }
      ASSERT_NE(compiled.backend_status().find("compiled"), std::string::npos) << compiled.backend_status();
      ASSERT_NE(interpreted->backend_status().find("interpreted"), std::string::npos) << interpreted->backend_status();
      testing::HostTensorSet a(compiled.plan(), sizes, d, 3), b(compiled.plan(), sizes, d, 3), fresh(compiled.plan(), sizes, d, 3);
      compiled.set_tensors(a.refs());
      interpreted->set_tensors(b.refs());
      for (int s = 1; s <= 4; ++s) {
        a.randomize_grads(40 + static_cast<uint64_t>(s));
        b.randomize_grads(40 + static_cast<uint64_t>(s));
        compiled.step();
        interpreted->step();
        ASSERT_EQ(testing::max_relative_difference(a, b), 0.0) << "step " << s;
      }
      EXPECT_GT(testing::max_relative_difference(fresh, a), 1e-4);  // it moved
    }
}

}  // namespace
}  // namespace optfuse
