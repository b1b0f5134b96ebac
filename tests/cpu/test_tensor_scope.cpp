// Per-tensor reductions (Scope::Tensor), checked against values derived by hand, on the reference
// evaluator and the CPU backend: each tensor sees the sum over its own elements only, tensor values
// mix group uniforms and per-tensor sums, a global and a per-tensor reduction share one pass, the
// planner moves a reduction to the later pass that reads its inputs anyway, and planning errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "runtime/chunks.h"
#include "runtime/tensor_table.h"

namespace optfuse {
namespace {

// update = -lr * g * (||g||_tensor^2 + 1) / (||g||_global^2): per-tensor and global sums in one pass.
Chain scaled_by_tensor_norm() {
  Rule r("scale_by_tensor_norm");
  r.hyper("lr", 0.5);
  r.update([](RuleBuilder& b) {
    Expr g = b.update();
    Expr t = b.name(tensor_sum_of_squares(g) + 1.0, "tensor_sq_plus_one");
    Expr all = global_sum_of_squares(g);
    return g * (t / all) * -b.hyper("lr");
  });
  return {r};
}

struct Tensors {
  std::vector<std::vector<float>> p, g;
  std::vector<TensorRef> refs() {
    std::vector<TensorRef> out;
    for (size_t i = 0; i < p.size(); ++i) {
      TensorRef t;
      t.param = {p[i].data(), static_cast<int64_t>(p[i].size()), DType::f32};
      t.grad = {g[i].data(), static_cast<int64_t>(g[i].size()), DType::f32};
      out.push_back(t);
    }
    return out;
  }
};

class TensorScope : public ::testing::TestWithParam<Backend> {};

TEST_P(TensorScope, EachTensorSeesOnlyItsOwnElements) {
  // Tensor 0: g = (1, 2) -> sum 5; tensor 1: g = (3) -> 9; tensor 2: 40000 elements of 0.01 -> 4
  // (several CPU chunks, combined per tensor); empty tensor 3 -> 0. Global sum 18.
  Tensors ts;
  ts.p = {{1, 1}, {1}, std::vector<float>(40000, 1.0f), {}};
  ts.g = {{1, 2}, {3}, std::vector<float>(40000, 0.01f), {}};
  Optimizer opt(scaled_by_tensor_norm(), GetParam());
  opt.set_tensors(ts.refs());
  opt.step();
  double global = 1 + 4 + 9 + 40000 * double(0.01f) * double(0.01f);
  double tensor2 = 40000 * double(0.01f) * double(0.01f);
  auto want = [&](double g, double tsum) { return 1.0 - 0.5 * g * (tsum + 1.0) / global; };
  EXPECT_NEAR(ts.p[0][0], want(1, 5), 1e-6);
  EXPECT_NEAR(ts.p[0][1], want(2, 5), 1e-6);
  EXPECT_NEAR(ts.p[1][0], want(3, 9), 1e-6);
  EXPECT_NEAR(ts.p[2][0], want(0.01f, tensor2), 1e-6);
  EXPECT_NEAR(ts.p[2][39999], want(0.01f, tensor2), 1e-6);
}

TEST_P(TensorScope, LambTrustRatioIsPerTensor) {
  // One Adam step from zero state has update = g/(|g| + eps') elementwise (~sign(g)), so with
  // weight_decay=0 and always_adapt the trust ratio is ||p|| / ||update||; lr = 1 and no clipping.
  Tensors ts;
  ts.p = {{3, 4}, {0, 0, 0}, {2}};
  ts.g = {{1, -1}, {1, 1, 1}, {-0.5}};
  Optimizer opt(make_builtin("lamb", {{"lr", 1.0}, {"weight_decay", 0.0}, {"always_adapt", true},
                                      {"max_grad_norm", 0.0}, {"eps", 0.0}}),
                GetParam());
  std::vector<std::vector<float>> m = {{0, 0}, {0, 0, 0}, {0}}, v = m;
  std::vector<TensorRef> refs = ts.refs();
  for (size_t i = 0; i < refs.size(); ++i)
    refs[i].states = {{m[i].data(), refs[i].param.numel, DType::f32}, {v[i].data(), refs[i].param.numel, DType::f32}};
  opt.set_tensors(refs);
  opt.step();
  // tensor 0: update (1, -1), ||p|| = 5, ||u|| = sqrt 2 -> p - u * 5/sqrt2
  EXPECT_NEAR(ts.p[0][0], 3 - 5 / std::sqrt(2.0), 1e-5);
  EXPECT_NEAR(ts.p[0][1], 4 + 5 / std::sqrt(2.0), 1e-5);
  // tensor 1: ||p|| = 0 -> ratio 1
  EXPECT_NEAR(ts.p[1][0], -1, 1e-6);
  // tensor 2: update -1, ||p|| = 2, ||u|| = 1 -> p + 2
  EXPECT_NEAR(ts.p[2][0], 4, 1e-5);
}

// update = -lr * g * (1 + max|g|_tensor) / max|g|_global: a max of abs per tensor and over all.
Chain scaled_by_max_abs() {
  Rule r("scale_by_max_abs");
  r.hyper("lr", 0.5);
  r.update([](RuleBuilder& b) {
    Expr g = b.update();
    return g * ((tensor_max_abs(g) + 1.0) / global_max_abs(g)) * -b.hyper("lr");
  });
  return {r};
}

TEST_P(TensorScope, MaxOfAbsPerTensorAndOverAll) {
  // Tensor 0: (1, -3) -> 3; tensor 1: (2) -> 2; tensor 2: 40000 x 0.01 with -0.5 at 33333 (a later
  // chunk) -> 0.5; empty tensor 3. Over all: 3.
  Tensors ts;
  ts.p = {{1, 1}, {1}, std::vector<float>(40000, 1.0f), {}};
  ts.g = {{1, -3}, {2}, std::vector<float>(40000, 0.01f), {}};
  ts.g[2][33333] = -0.5f;
  Optimizer opt(scaled_by_max_abs(), GetParam());
  opt.set_tensors(ts.refs());
  opt.step();
  auto want = [](double g, double tmax) { return 1.0 - 0.5 * g * (tmax + 1.0) / 3.0; };
  EXPECT_NEAR(ts.p[0][1], want(-3, 3), 1e-6);
  EXPECT_NEAR(ts.p[1][0], want(2, 2), 1e-6);
  EXPECT_NEAR(ts.p[2][0], want(0.01f, 0.5), 1e-6);
  EXPECT_NEAR(ts.p[2][33333], want(-0.5f, 0.5), 1e-6);
  // A NaN anywhere makes the global max NaN (torch.max's rule): every parameter becomes NaN.
  ts.g[1][0] = NAN;
  opt.step();
  EXPECT_TRUE(std::isnan(ts.p[0][0]));
  EXPECT_TRUE(std::isnan(ts.p[2][5]));
}

INSTANTIATE_TEST_SUITE_P(Backends, TensorScope, ::testing::Values(Backend::reference, Backend::cpu),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(TensorTable, ChunkRangesGiveEachTensorItsChunks) {
  // What the CUDA last block walks per tensor: sizes 5, 0 (no chunks), 9 and 4 with 4-element chunks.
  std::vector<float> data(9);
  std::vector<TensorRef> ts(4);
  int64_t sizes[] = {5, 0, 9, 4};
  for (size_t i = 0; i < 4; ++i) ts[i].param = ts[i].grad = {data.data(), sizes[i], DType::f32};
  std::vector<Chunk> chunks = build_chunks(ts, 4);
  ASSERT_EQ(chunks.size(), 6u);  // 2 + 0 + 3 + 1
  std::vector<ChunkRange> r = chunk_ranges(ts.size(), chunks);
  EXPECT_EQ(r[0].first, 0u);
  EXPECT_EQ(r[0].count, 2u);
  EXPECT_EQ(r[1].count, 0u);
  EXPECT_EQ(r[2].first, 2u);
  EXPECT_EQ(r[2].count, 3u);
  EXPECT_EQ(r[3].first, 5u);
  EXPECT_EQ(r[3].count, 1u);
  std::vector<uint64_t> words = build_tensor_table(ts, 0, r, std::vector<int>(ts.size(), 0));
  const size_t row = tensor_row_words(0);  // param, grad pointers; numel; group|variant; chunk range; rng key, offset
  ASSERT_EQ(words.size(), 4 * row + 4);  // and the gradient-pointer tail
  EXPECT_EQ(words[2 * row + 4], uint64_t{2} | (uint64_t{3} << 32));
  EXPECT_EQ(words[3 * row + 4], uint64_t{5} | (uint64_t{1} << 32));
  EXPECT_EQ(grad_tail_word(4, 0), 4 * row);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(words[4 * row + i], reinterpret_cast<uint64_t>(ts[i].grad.data));
}

TEST(TensorScopePlan, GlobalAndTensorSumsShareOnePass) {
  Plan plan = make_plan(scaled_by_tensor_norm());
  ASSERT_EQ(plan.phases.size(), 2u);
  EXPECT_EQ(plan.phases[0].reductions.size(), 2u);
  EXPECT_EQ(plan.layout.reductions, 1);
  EXPECT_EQ(plan.layout.tensor_reductions, 1);
  EXPECT_EQ(plan.layout.tensor_values, 1);
}

TEST(TensorScopePlan, LambMovesTheParamNormIntoTheUpdateNormPass) {
  // ||param|| needs no clipping but is only used next to ||update||: it joins that pass, so the
  // clip pass reads only the gradient (4 B). That pass also writes m and v (test_states_ahead.cpp):
  // 4 + 24 + 16 = 44 bytes per float32 element.
  Plan plan = make_plan(make_builtin("lamb"));
  ASSERT_EQ(plan.phases.size(), 3u);
  EXPECT_FALSE(plan.phases[0].reads_param);
  EXPECT_EQ(plan.phases[0].reductions.size(), 1u);
  EXPECT_EQ(plan.phases[1].reductions.size(), 2u);
  int bytes = 0;
  for (const ElementPhase& ph : plan.phases) bytes += 4 * (ph.reads() + ph.writes());
  EXPECT_EQ(bytes, 44);
  // Without clipping: one reduce pass (p, g, m, v) and the update.
  Plan noclip = make_plan(make_builtin("lamb", {{"max_grad_norm", 0.0}}));
  EXPECT_EQ(noclip.phases.size(), 2u);
}

TEST(TensorScopePlan, PerTensorValuesCannotSkipTheStep) {
  Rule r("skip_on_tensor");
  r.update([](RuleBuilder& b) {
    b.skip_step_if(tensor_any_nonfinite(b.update()));
    return b.update();
  });
  try {
    make_plan(Chain{r});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a per-tensor one"), std::string::npos) << e.what();
  }
}

TEST(TensorScopePlan, ReducingATensorValueIsAnError) {
  Rule r("reduce_tensor_value");
  r.update([](RuleBuilder& b) { return b.update() + global_sum_of_squares(tensor_sum_of_squares(b.update())); });
  EXPECT_THROW(make_plan(Chain{r}), Error);
}

}  // namespace
}  // namespace optfuse
