// A matrix view that is a batch of matrices (TensorRef::matrix_rows; torch's Adafactor factors each
// matrix of a parameter of more than 2 dimensions): every row, column and sum of row values is the
// matrix's own. The oracle: the same matrices given as separate tensors, with chains whose only
// per-tensor quantities are sums of row values (which are per matrix) step bitwise alike, on the
// reference evaluator and the CPU backend. Also the chunking (a chunk never spans two matrices) and
// the errors of bad batches.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "runtime/chunks.h"
#include "runtime/matrix_tables.h"
#include "testing/error_of.h"
#include "testing/matrix_rules.h"

namespace optfuse {
namespace {

// One parameter of shape (B, R, C) in float32 with its two per-row / per-column states.
struct Batch {
  int64_t B, R, C;
  std::vector<float> p, g, rows, cols;
  Batch(int64_t b, int64_t r, int64_t c) : B(b), R(r), C(c) {
    const int64_t n = b * r * c;
    for (int64_t i = 0; i < n; ++i) {
      p.push_back(1.0f + static_cast<float>(i % 13) / 16.0f);
      g.push_back(static_cast<float>((i * 7919 % 23) - 11) / 8.0f);
    }
    rows.assign(static_cast<size_t>(b * r), 0.0f);
    cols.assign(static_cast<size_t>(b * c), 0.0f);
  }
  // The whole batch as one tensor, or matrix `m` alone (a view into the same kind of data).
  TensorRef whole() { return ref(p.data(), g.data(), rows.data(), cols.data(), B * R * C, R); }
  TensorRef matrix(int64_t m) {
    return ref(p.data() + m * R * C, g.data() + m * R * C, rows.data() + m * R, cols.data() + m * C, R * C, 0);
  }
  TensorRef ref(float* pp, float* gg, float* rr, float* cc, int64_t n, int64_t matrix_rows) const {
    TensorRef t;
    t.param = {pp, n, DType::f32};
    t.grad = {gg, n, DType::f32};
    t.states = {{rr, n / C, DType::f32}, {cc, n / C / R * C, DType::f32}};
    t.cols = C;
    t.matrix_rows = matrix_rows;
    return t;
  }
};

class MatrixBatches : public ::testing::TestWithParam<Backend> {};

TEST_P(MatrixBatches, EachMatrixOfABatchIsSteppedAsIfAlone) {
  // Small matrices (whole ones in a chunk: 3000 3 x 3 ones are two chunks of the CPU's 16384
  // elements; 1 x 1 ones), matrices of several chunks (300 x 301: 90300 elements, chunks of 16384 or 65536 whole
  // rows, the last one of each matrix short) and one-row matrices.
  // alpha = max(eps2, RMS(p)) * rho and the RMS clip max(RMS(update) / d, 1) are constants here
  Chain adafactor_per_matrix = make_builtin("scale_by_adafactor", {{"lr", 0.05}, {"eps2", 1e3}, {"d", 1e30}});
  for (const Chain& c : {Chain{testing::row_and_column_max()}, adafactor_per_matrix}) {
    std::vector<Batch> batched = {Batch(3, 4, 5), Batch(2, 300, 301), Batch(5, 1, 7), Batch(3000, 3, 3), Batch(300, 1, 1)};
    std::vector<Batch> alone = batched;
    std::vector<TensorRef> whole, separate;
    for (Batch& b : batched) whole.push_back(b.whole());
    for (Batch& b : alone)
      for (int64_t m = 0; m < b.B; ++m) separate.push_back(b.matrix(m));
    Optimizer one(c, GetParam()), many(c, GetParam());
    one.set_tensors(whole);
    many.set_tensors(separate);
    for (int s = 0; s < 3; ++s) {
      one.step();
      many.step();
    }
    for (size_t k = 0; k < batched.size(); ++k) {
      SCOPED_TRACE(build_program(c).chain_text + ", batch " + std::to_string(k));
      EXPECT_EQ(batched[k].p, alone[k].p);
      EXPECT_EQ(batched[k].rows, alone[k].rows);
      EXPECT_EQ(batched[k].cols, alone[k].cols);
      const Batch start(batched[k].B, batched[k].R, batched[k].C);
      EXPECT_NE(batched[k].p, start.p);  // it stepped
      EXPECT_NE(batched[k].cols, start.cols);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, MatrixBatches, ::testing::Values(Backend::reference, Backend::cpu),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(MatrixBatches, AdafactorOnTheCpuMatchesTheReference) {
  // The per-tensor norms span the whole batch here (no constants): the CPU's float32 loops against
  // the float64 reference, 5 steps.
  Chain c = adafactor({{"lr", 0.05}, {"weight_decay", 0.1}});
  std::vector<Batch> rb = {Batch(3, 4, 5), Batch(2, 300, 301), Batch(4, 64, 1), Batch(600, 3, 3)}, cb = rb;
  std::vector<TensorRef> rr, cr;
  for (Batch& b : rb) rr.push_back(b.whole());
  for (Batch& b : cb) cr.push_back(b.whole());
  Optimizer ref(c, Backend::reference), cpu(c, Backend::cpu);
  ref.set_tensors(rr);
  cpu.set_tensors(cr);
  for (int s = 0; s < 5; ++s) {
    ref.step();
    cpu.step();
  }
  for (size_t k = 0; k < rb.size(); ++k)
    for (size_t i = 0; i < rb[k].p.size(); ++i)
      ASSERT_NEAR(cb[k].p[i], rb[k].p[i], 2e-6 * std::max(1.0f, std::fabs(rb[k].p[i]))) << k << " " << i;
}

TEST(MatrixBatches, ChunksNeverSpanTwoMatricesAndHoldWholeSmallOnes) {
  std::vector<float> data(2000);
  std::vector<TensorRef> ts(2);
  ts[0].param = {data.data(), 3 * 20 * 16, DType::f32};  // 3 matrices of 20 x 16 (320 elements: not small)
  ts[0].cols = 16;
  ts[0].matrix_rows = 20;
  ts[1].param = {data.data(), 50 * 2 * 3, DType::f32};  // 50 matrices of 2 x 3 (small): 10 whole ones per chunk
  ts[1].cols = 3;
  ts[1].matrix_rows = 2;
  std::vector<Chunk> chunks = build_chunks(ts, 96, true);  // 6 rows of 16, or 16 small matrices
  ASSERT_EQ(chunks.size(), 3u * 4 + 4);
  for (int m = 0; m < 3; ++m)  // rows 0-5, 6-11, 12-17, 18-19 of each matrix
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(chunks[static_cast<size_t>(4 * m + j)].begin, 320 * m + 96 * j);
      EXPECT_EQ(chunks[static_cast<size_t>(4 * m + j)].length, j < 3 ? 96 : 32);
    }
  for (int j = 0; j < 4; ++j) EXPECT_EQ(chunks[static_cast<size_t>(12 + j)].length, j < 3 ? 96 : 12);
  MatrixLayout ml = matrix_layout(ts, chunk_ranges(ts.size(), chunks));
  EXPECT_EQ(ml.rows, 60 + 100);
  EXPECT_EQ(ml.cols, 3 * 16 + 50 * 3);  // per matrix and column
  EXPECT_EQ(ml.matrices, 53);
  EXPECT_EQ(ml.chunks_per_matrix[0], 4);
  EXPECT_EQ(ml.chunks_per_matrix[1], 1);  // (whole matrices: one partial per matrix and column)
  EXPECT_EQ(ml.matrix_offset[1], 3);
  EXPECT_EQ(ml.colparts, 12 * 16 + 50 * 3);
  const std::vector<ValueItem> items = value_items(ts, 32, 2048);
  ASSERT_EQ(items.size(), 3u * 2 + 1);  // per big matrix a column item and a row item; one item of whole matrices
  for (int m = 0; m < 3; ++m) {  // a matrix's items: its column item (spanning both), then its row item
    EXPECT_EQ(items[static_cast<size_t>(2 * m)].rows, 0);
    EXPECT_EQ(items[static_cast<size_t>(2 * m)].first, 2 * m);
    EXPECT_EQ(items[static_cast<size_t>(2 * m)].items, 2);
    EXPECT_EQ(items[static_cast<size_t>(2 * m + 1)].rows, 1);
    EXPECT_EQ(items[static_cast<size_t>(2 * m + 1)].first, 2 * m + 1);
    EXPECT_EQ(items[static_cast<size_t>(2 * m + 1)].items, 1);
  }
  EXPECT_EQ(items[6].rows, 2);
  EXPECT_EQ(items[6].count, 50);
}

TEST(MatrixBatches, BadBatchesAreRefusedClearly) {
  Batch b(2, 3, 4);
  Optimizer opt(Chain{testing::row_and_column_max()}, Backend::reference);
  TensorRef t = b.whole();
  t.matrix_rows = 4;  // 6 rows are not matrices of 4
  EXPECT_EQ(testing::error_of([&] { opt.set_tensors({t}); }),
            "tensor 0: matrices of 4 rows do not divide its 6 rows of 4 columns");
  t = b.whole();
  t.cols = 0;
  t.states[0].numel = 24;
  EXPECT_EQ(testing::error_of([&] { opt.set_tensors({t}); }),
            "tensor 0: matrices of 3 rows do not divide its view (a batch of matrices needs cols > 0)");
  t = b.whole();
  t.states[1].numel = 4;  // one column state per matrix and column: 8
  EXPECT_EQ(testing::error_of([&] { opt.set_tensors({t}); }),
            "tensor 0: state row_and_column_max.cols holds one value per column of the view as a batch of 2 3 x 4 "
            "matrices: 8 elements, got 4");
}

}  // namespace
}  // namespace optfuse
