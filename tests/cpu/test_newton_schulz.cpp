// The matrix phase on the CPU (OpenBLAS sgemm on bf16 values), against a plain-loop reference of
// torch.optim.Muon's Newton-Schulz written here, and its own invariants: a tall matrix is the
// transpose of the wide one, a batch is its matrices one by one, every dtype, bad input refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "optfuse/dtype.h"
#include "optfuse/error.h"
#include "optfuse/newton_schulz.h"
#include "testing/error_of.h"
#include "testing/random_values.h"

namespace {

using optfuse::Backend;
using optfuse::DType;
using optfuse::NewtonSchulz;
using optfuse::testing::error_of;

float bf(float x) { return optfuse::bf16_bits_to_float(optfuse::float_to_bf16_bits(x)); }

#define REQUIRE_CPU_GEMM()                                              \
  do {                                                                  \
    std::string why_;                                                   \
    if (!optfuse::gemm_available(Backend::cpu, &why_)) GTEST_SKIP() << why_; \
  } while (0)

std::vector<float> random_matrix(int64_t n, unsigned seed) {
  return optfuse::testing::normal_values(static_cast<size_t>(n), seed);
}

// torch.optim.Muon's _zeropower_via_newtonschulz for one wide (rows <= cols) row-major matrix, each
// product a plain triple loop with a float32 sum in index order, each result rounded to bf16.
std::vector<float> reference(std::vector<float> x, int s, int l, const optfuse::NewtonSchulzOptions& o) {
  double sq = 0;
  for (float& v : x) {
    v = bf(v);
    sq += double(v) * v;
  }
  const float norm = bf(std::fmax(bf(float(std::sqrt(sq))), float(o.eps)));
  for (float& v : x) v = bf(v / norm);
  auto [a, b, c] = o.coefficients;
  for (int step = 0; step < o.steps; ++step) {
    std::vector<float> A(size_t(s) * s), B(size_t(s) * s), Xn(x.size());
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < s; ++j) {
        float acc = 0;
        for (int k = 0; k < l; ++k) acc += x[size_t(i) * l + k] * x[size_t(j) * l + k];
        A[size_t(i) * s + j] = bf(acc);
      }
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < s; ++j) {
        float acc = 0;
        for (int k = 0; k < s; ++k) acc += A[size_t(i) * s + k] * A[size_t(k) * s + j];
        B[size_t(i) * s + j] = bf(float(c) * acc + float(b) * A[size_t(i) * s + j]);
      }
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < l; ++j) {
        float acc = 0;
        for (int k = 0; k < s; ++k) acc += B[size_t(i) * s + k] * x[size_t(k) * l + j];
        Xn[size_t(i) * l + j] = bf(acc + float(a) * x[size_t(i) * l + j]);
      }
    x = Xn;
  }
  return x;
}

TEST(NewtonSchulz, MatchesThePlainLoopReferenceWithinBf16Rounding) {
  REQUIRE_CPU_GEMM();
  const int s = 24, l = 40;
  std::vector<float> m = random_matrix(s * l, 1), expect = reference(m, s, l, {});
  NewtonSchulz ns(Backend::cpu, {DType::f32, 1, s, l});
  ns.run(m.data());
  // The library sums products in another order than the loop: one bf16 rounding may flip, and five
  // iterations carry it on. Entries are O(1/sqrt(s)) ~ 0.2, where a bf16 ulp is ~1e-3 (measured: 4.9e-4).
  double worst = 0;
  for (size_t i = 0; i < m.size(); ++i) worst = std::max(worst, double(std::fabs(m[i] - expect[i])));
  EXPECT_LT(worst, 4e-3) << "largest difference to the reference";
  std::printf("largest difference to the plain-loop reference: %.3g\n", worst);
  // Orthogonalised: every singular value of X is near 1, so the diagonal of X X^T is too (Muon's
  // quintic leaves them in about [0.7, 1.2]).
  for (int i = 0; i < s; ++i) {
    double d = 0;
    for (int k = 0; k < l; ++k) d += double(m[size_t(i) * l + k]) * m[size_t(i) * l + k];
    EXPECT_GT(d, 0.4) << "row " << i;
    EXPECT_LT(d, 1.6) << "row " << i;
  }
}

TEST(NewtonSchulz, TallMatrixIsTheTransposeOfTheWideOneBitwise) {
  REQUIRE_CPU_GEMM();
  const int rows = 48, cols = 20;
  std::vector<float> tall = random_matrix(rows * cols, 2), wide(tall.size());
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) wide[size_t(j) * rows + i] = tall[size_t(i) * cols + j];
  NewtonSchulz(Backend::cpu, {DType::f32, 1, rows, cols}).run(tall.data());
  NewtonSchulz(Backend::cpu, {DType::f32, 1, cols, rows}).run(wide.data());
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j)
      ASSERT_EQ(tall[size_t(i) * cols + j], wide[size_t(j) * rows + i]) << i << "," << j;
}

TEST(NewtonSchulz, ABatchIsItsMatricesOneByOneBitwise) {
  REQUIRE_CPU_GEMM();
  const int b = 3, r = 16, c = 24;
  std::vector<float> batch = random_matrix(b * r * c, 3);
  std::vector<std::vector<float>> alone;
  for (int k = 0; k < b; ++k) alone.emplace_back(batch.begin() + k * r * c, batch.begin() + (k + 1) * r * c);
  NewtonSchulz(Backend::cpu, {DType::f32, b, r, c}).run(batch.data());
  NewtonSchulz one(Backend::cpu, {DType::f32, 1, r, c});
  for (int k = 0; k < b; ++k) {
    one.run(alone[k].data());
    for (int i = 0; i < r * c; ++i) ASSERT_EQ(batch[size_t(k) * r * c + i], alone[k][i]) << "matrix " << k;
  }
}

TEST(NewtonSchulz, EveryDtypeStoresTheBf16ResultRoundedToIt) {
  REQUIRE_CPU_GEMM();
  const int r = 12, c = 20;
  std::vector<float> f = random_matrix(r * c, 4);
  std::vector<uint16_t> as_bf16(f.size()), as_f16(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = bf(f[i]);  // exactly representable in bf16 and (for these magnitudes) close in f16
    as_bf16[i] = optfuse::float_to_bf16_bits(f[i]);
  }
  NewtonSchulz(Backend::cpu, {DType::f32, 1, r, c}).run(f.data());
  NewtonSchulz(Backend::cpu, {DType::bf16, 1, r, c}).run(as_bf16.data());
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(optfuse::bf16_bits_to_float(as_bf16[i]), f[i]) << i;  // bf16 results are exact in both
    EXPECT_EQ(bf(f[i]), f[i]) << "a float32 result holds a bf16 value";
  }
  std::vector<float> g = random_matrix(r * c, 5);
  for (size_t i = 0; i < g.size(); ++i) as_f16[i] = optfuse::float_to_f16_bits(g[i]);
  std::vector<float> from_f16(g.size());
  for (size_t i = 0; i < g.size(); ++i) from_f16[i] = optfuse::f16_bits_to_float(as_f16[i]);
  NewtonSchulz(Backend::cpu, {DType::f16, 1, r, c}).run(as_f16.data());
  NewtonSchulz(Backend::cpu, {DType::f32, 1, r, c}).run(from_f16.data());
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_EQ(as_f16[i], optfuse::float_to_f16_bits(from_f16[i])) << i;
}

TEST(NewtonSchulz, ZeroStepsOnlyNormalisesAndAZeroMatrixStaysZero) {
  REQUIRE_CPU_GEMM();
  std::vector<float> m = random_matrix(8 * 8, 6);
  optfuse::NewtonSchulzOptions o;
  o.steps = 0;
  NewtonSchulz(Backend::cpu, {DType::f32, 1, 8, 8}, o).run(m.data());
  double sq = 0;
  for (float v : m) sq += double(v) * v;
  EXPECT_NEAR(std::sqrt(sq), 1.0, 1e-2);
  std::vector<float> z(8 * 8, 0.0f);
  NewtonSchulz(Backend::cpu, {DType::f32, 1, 8, 8}).run(z.data());  // norm clamped to eps: 0 / eps
  for (float v : z) ASSERT_EQ(v, 0.0f);
}

TEST(NewtonSchulz, BadInputIsRefusedWithAClearError) {
  optfuse::NewtonSchulzOptions many;
  many.steps = 100;
  EXPECT_NE(error_of([&] { NewtonSchulz(Backend::cpu, {DType::f32, 1, 4, 4}, many); }).find("steps"), std::string::npos);
  EXPECT_NE(error_of([&] { NewtonSchulz(Backend::cpu, {DType::i16, 1, 4, 4}); }).find("float32"), std::string::npos);
  EXPECT_NE(error_of([&] { NewtonSchulz(Backend::cpu, {DType::f32, 0, 4, 4}); }).find("positive"), std::string::npos);
  EXPECT_NE(error_of([&] { NewtonSchulz(Backend::reference, {DType::f32, 1, 4, 4}); }).find("reference"),
            std::string::npos);
  optfuse::NewtonSchulzOptions nan;
  nan.coefficients[1] = NAN;
  EXPECT_NE(error_of([&] { NewtonSchulz(Backend::cpu, {DType::f32, 1, 4, 4}, nan); }).find("finite"), std::string::npos);
}

TEST(NewtonSchulz, FlopsCountTheThreeProductsOfEveryStep) {
  REQUIRE_CPU_GEMM();
  NewtonSchulz ns(Backend::cpu, {DType::f32, 2, 10, 30});  // s = 10, l = 30, 5 steps
  EXPECT_DOUBLE_EQ(ns.flops(), 2.0 * 5 * (2 * 10 * 10 * 30 + 2 * 10 * 10 * 10 + 2 * 10 * 30 * 10));
}

}  // namespace
