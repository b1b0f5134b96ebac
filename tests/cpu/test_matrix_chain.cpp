// Chains with a matrix phase (MatrixChainOptimizer): Muon on the CPU against torch.optim.Muon's math
// written out here (float64 element math, the core's Newton-Schulz for the matrix phase), the split
// and its schedule, every refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "codegen/explain.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/dtype.h"
#include "optfuse/error.h"
#include "optfuse/matrix_chain.h"
#include "optfuse/newton_schulz.h"
#include "testing/error_of.h"

namespace optfuse {
namespace {

using testing::error_of;

#define REQUIRE_CPU_GEMM()                                                 \
  do {                                                                     \
    std::string why_;                                                      \
    if (!gemm_available(Backend::cpu, &why_)) GTEST_SKIP() << why_;        \
  } while (0)

struct Matrix {
  int64_t rows, cols;
  std::vector<float> p, g, buf;
};

std::vector<Matrix> make_matrices(const std::vector<std::pair<int64_t, int64_t>>& shapes, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<Matrix> out;
  for (auto [r, c] : shapes) {
    Matrix m{r, c, {}, {}, std::vector<float>(static_cast<size_t>(r * c), 0.0f)};
    for (int64_t i = 0; i < r * c; ++i) m.p.push_back(d(gen) * 0.1f);
    out.push_back(m);
  }
  return out;
}

std::vector<TensorRef> refs(std::vector<Matrix>& ms) {
  std::vector<TensorRef> out;
  for (Matrix& m : ms) {
    TensorRef t;
    t.param = {m.p.data(), m.rows * m.cols, DType::f32};
    t.grad = {m.g.data(), m.rows * m.cols, DType::f32};
    t.states = {{m.buf.data(), m.rows * m.cols, DType::f32}};
    t.cols = m.cols;
    out.push_back(t);
  }
  return out;
}

void new_gradients(std::vector<Matrix>& ms, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (Matrix& m : ms) {
    m.g.assign(static_cast<size_t>(m.rows * m.cols), 0.0f);
    for (float& x : m.g) x = d(gen);
  }
}

// torch.optim.Muon's step for one matrix, element math in float64 (then float32 storage), the
// matrix phase by the core's CPU Newton-Schulz (the part under test elsewhere).
void torch_muon_step(Matrix& m, double lr, double wd, double mom, bool nesterov, int adjust) {
  const size_t n = m.p.size();
  std::vector<float> u(n);
  for (size_t i = 0; i < n; ++i) {
    const double b = m.buf[i] + (1 - mom) * (double(m.g[i]) - m.buf[i]);
    m.buf[i] = static_cast<float>(b);
    u[i] = static_cast<float>(nesterov ? m.g[i] + mom * (double(m.buf[i]) - m.g[i]) : m.buf[i]);
  }
  NewtonSchulz(Backend::cpu, {DType::f32, 1, m.rows, m.cols}).run(u.data());
  const double A = double(m.rows), B = double(m.cols);
  const double ratio = adjust == 0 ? std::sqrt(std::max(1.0, A / B)) : adjust == 1 ? 0.2 * std::sqrt(std::max(A, B))
                                                                                  : std::sqrt(A / B);
  for (size_t i = 0; i < n; ++i) m.p[i] = static_cast<float>(m.p[i] * (1 - lr * wd) - lr * ratio * u[i]);
}

TEST(MatrixChain, MuonMatchesTorchsMathOverTenSteps) {
  REQUIRE_CPU_GEMM();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{24, 40}, {40, 24}, {24, 40}, {16, 16}};
  for (int adjust : {0, 1}) {
    for (bool nesterov : {true, false}) {
      std::vector<Matrix> ours = make_matrices(shapes, 1), ref = ours;
      MatrixChainOptimizer opt(make_builtin("muon", {{"lr", 0.02}, {"weight_decay", 0.1}, {"momentum", 0.9},
                                                     {"nesterov", nesterov}, {"adjust_lr", double(adjust)}}),
                               Backend::cpu);
      for (int step = 0; step < 10; ++step) {
        new_gradients(ours, 100 + step);
        new_gradients(ref, 100 + step);
        opt.set_tensors(refs(ours));  // new gradient buffers every step, as a training loop has
        opt.step();
        for (Matrix& m : ref) torch_muon_step(m, 0.02, 0.1, 0.9, nesterov, adjust);
      }
      EXPECT_EQ(opt.step_count(0), 10);
      double worst = 0, worst_buf = 0;
      for (size_t t = 0; t < ours.size(); ++t)
        for (size_t i = 0; i < ours[t].p.size(); ++i) {
          worst = std::max(worst, double(std::fabs(ours[t].p[i] - ref[t].p[i])));
          worst_buf = std::max(worst_buf, double(std::fabs(ours[t].buf[i] - ref[t].buf[i])));
        }
      // Element math differs by float32 roundings (~1e-7 relative); a flipped bf16 rounding in the
      // matrix phase moves an entry of O by a bf16 ulp (~4e-3 here) times lr * ratio per step.
      EXPECT_LE(worst_buf, 1e-5) << "adjust " << adjust << " nesterov " << nesterov;
      EXPECT_LE(worst, 10 * 0.02 * 1.3 * 2 * 4e-3) << "adjust " << adjust << " nesterov " << nesterov;
      double moved = 0;
      std::vector<Matrix> start = make_matrices(shapes, 1);
      for (size_t t = 0; t < ours.size(); ++t)
        for (size_t i = 0; i < ours[t].p.size(); ++i) moved = std::max(moved, double(std::fabs(ours[t].p[i] - start[t].p[i])));
      EXPECT_GT(moved, 0.05) << "the parameters moved";
    }
  }
}

TEST(MatrixChain, SplitsTheChainAndPrintsTheSchedule) {
  REQUIRE_CPU_GEMM();
  MatrixChainOptimizer opt(make_builtin("muon"), Backend::cpu);
  std::vector<Matrix> ms = make_matrices({{8, 12}, {8, 12}, {12, 8}}, 2);
  new_gradients(ms, 3);
  opt.set_tensors(refs(ms));
  ASSERT_EQ(opt.states().size(), 1u);
  EXPECT_EQ(opt.states()[0].name, "momentum_buffer");
  const std::string d = opt.describe();
  EXPECT_NE(d.find("matrix: newton_schulz(a=3.4445, b=-4.775, c=2.0315, steps=5, eps=1e-07)"), std::string::npos) << d;
  EXPECT_NE(d.find("2 x 8x12 float32"), std::string::npos) << d;
  EXPECT_NE(d.find("1 x 12x8 float32"), std::string::npos) << d;
  // one pass in (16 B/element: grad, buffer read; buffer, scratch written), one pass out (12 B)
  EXPECT_EQ(opt.part(0).plan().phases.size(), 1u);
  EXPECT_EQ(opt.part(1).plan().phases.size(), 1u);
  EXPECT_EQ(4 * (opt.part(0).plan().phases[0].reads() + opt.part(0).plan().phases[0].writes()), 16);
  EXPECT_EQ(4 * (opt.part(1).plan().phases[0].reads() + opt.part(1).plan().phases[0].writes()), 12);
  const std::string text = explain_text(make_builtin("muon"), "cpu", false);
  EXPECT_NE(text.find("######## matrix phase"), std::string::npos);
  EXPECT_NE(text.find("15 products per batch"), std::string::npos);
}

TEST(MatrixChain, HyperparametersReachBothPartsAndFoundInfSkips) {
  REQUIRE_CPU_GEMM();
  MatrixChainOptimizer opt(make_builtin("muon"), Backend::cpu);
  opt.set_hyper(0, "lr", 0.5);
  EXPECT_EQ(opt.part(1).hyper(0, "decoupled_weight_decay.lr"), 0.5);
  EXPECT_EQ(opt.part(1).hyper(0, "scale_by_muon_lr.lr"), 0.5);
  opt.set_hyper(0, "momentum", 0.5);
  EXPECT_EQ(opt.hyper(0, "momentum"), 0.5);
  EXPECT_NE(error_of([&] { opt.set_hyper(0, "betas", 0.1); }).find("no hyperparameter 'betas'"), std::string::npos);
  EXPECT_NE(error_of([&] { opt.set_hyper(0, "lr", -1.0); }), "<no error>");
  EXPECT_EQ(opt.hyper(0, "lr"), 0.5) << "a refused value changes nothing";
  std::vector<Matrix> ms = make_matrices({{6, 10}}, 4);
  new_gradients(ms, 5);
  opt.set_tensors(refs(ms));
  const std::vector<float> p0 = ms[0].p, b0 = ms[0].buf;
  const float inf_found = 1.0f;
  opt.step({nullptr, &inf_found, nullptr});
  EXPECT_EQ(ms[0].p, p0);
  EXPECT_EQ(ms[0].buf, b0);
  EXPECT_EQ(opt.step_count(0), 0);
  opt.step();
  EXPECT_NE(ms[0].p, p0);
  EXPECT_EQ(opt.step_count(0), 1);
}

TEST(MatrixChain, GradScalerScaledGradientsGiveTheUnscaledStepBitwise) {
  REQUIRE_CPU_GEMM();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{12, 20}, {20, 12}};
  std::vector<Matrix> plain = make_matrices(shapes, 8), scaled = plain;
  MatrixChainOptimizer a(make_builtin("muon"), Backend::cpu);
  MatrixChainOptimizer b(chain({make_builtin("unscale_by_grad_scale"), make_builtin("muon")}), Backend::cpu);
  const float scale = 1024.0f, no_inf = 0.0f;
  for (int step = 0; step < 3; ++step) {
    new_gradients(plain, 20 + step);
    new_gradients(scaled, 20 + step);
    for (Matrix& m : scaled)
      for (float& x : m.g) x *= scale;  // exact: a power of two
    a.set_tensors(refs(plain));
    b.set_tensors(refs(scaled));
    a.step();
    b.step({&scale, &no_inf, nullptr});
  }
  for (size_t t = 0; t < plain.size(); ++t) {
    EXPECT_EQ(plain[t].p, scaled[t].p);
    EXPECT_EQ(plain[t].buf, scaled[t].buf);
  }
}

TEST(MatrixChain, Bfloat16ParametersFollowTheFloat32Run) {
  REQUIRE_CPU_GEMM();
  // bf16 parameters, gradients and momentum (the scratch is bf16 too, as torch's update is):
  // within bf16 rounding of a float32 run from the same (bf16-representable) start.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{16, 24}, {24, 16}};
  std::vector<Matrix> f32 = make_matrices(shapes, 9);
  for (Matrix& m : f32)
    for (float& x : m.p) x = bf16_bits_to_float(float_to_bf16_bits(x));
  std::vector<std::vector<uint16_t>> p16, g16, b16;
  for (Matrix& m : f32) {
    p16.emplace_back();
    for (float x : m.p) p16.back().push_back(float_to_bf16_bits(x));
    b16.emplace_back(m.p.size(), 0);
  }
  MatrixChainOptimizer a(make_builtin("muon", {{"lr", 0.02}}), Backend::cpu), b(make_builtin("muon", {{"lr", 0.02}}), Backend::cpu);
  for (int step = 0; step < 5; ++step) {
    new_gradients(f32, 30 + step);
    g16.clear();
    std::vector<TensorRef> r16;
    for (size_t t = 0; t < f32.size(); ++t) {
      for (float& x : f32[t].g) x = bf16_bits_to_float(float_to_bf16_bits(x));
      g16.emplace_back();
      for (float x : f32[t].g) g16.back().push_back(float_to_bf16_bits(x));
    }
    for (size_t t = 0; t < f32.size(); ++t) {
      const int64_t n = int64_t(p16[t].size());
      TensorRef r;
      r.param = {p16[t].data(), n, DType::bf16};
      r.grad = {g16[t].data(), n, DType::bf16};
      r.states = {{b16[t].data(), n, DType::bf16}};
      r.cols = f32[t].cols;
      r16.push_back(r);
    }
    a.set_tensors(refs(f32));
    b.set_tensors(r16);
    a.step();
    b.step();
  }
  double worst = 0, moved = 0;
  std::vector<Matrix> start = make_matrices(shapes, 9);
  for (size_t t = 0; t < f32.size(); ++t)
    for (size_t i = 0; i < f32[t].p.size(); ++i) {
      worst = std::max(worst, double(std::fabs(bf16_bits_to_float(p16[t][i]) - f32[t].p[i])));
      moved = std::max(moved, double(std::fabs(f32[t].p[i] - start[t].p[i])));
    }
  // a bf16 ulp of parameters up to ~0.4 is 2e-3 per store; 5 steps
  EXPECT_LE(worst, 5 * 2e-3) << "bf16 run against float32";
  EXPECT_GT(moved, 0.02);
  EXPECT_NE(b.describe().find("bfloat16"), std::string::npos);
}

TEST(MatrixChain, BadChainsAndTensorsAreRefused) {
  const NewtonSchulzOptions ns;
  auto matrix = make_builtin("newton_schulz");
  auto lr = make_builtin("scale_by_learning_rate");
  auto momentum = make_builtin("scale_by_muon_momentum");
  EXPECT_NE(error_of([&] { Optimizer(make_builtin("muon"), Backend::cpu); }).find("MatrixChainOptimizer"), std::string::npos);
  EXPECT_NE(error_of([&] { split_matrix_chain(chain({momentum, lr})); }).find("exactly one matrix rule"), std::string::npos);
  EXPECT_NE(error_of([&] { split_matrix_chain(chain({momentum, matrix, matrix, lr})); }).find("has 2"), std::string::npos);
  EXPECT_NE(error_of([&] { split_matrix_chain(chain({matrix, lr})); }).find("before it"), std::string::npos);
  EXPECT_NE(error_of([&] { split_matrix_chain(chain({momentum, matrix})); }).find("after it"), std::string::npos);
  EXPECT_NE(error_of([&] {
              MatrixChainOptimizer(chain({make_builtin("add_decayed_weights", {{"weight_decay", 0.1}}), matrix, lr}),
                                   Backend::cpu);
            }).find("read the parameter"),
            std::string::npos);
  EXPECT_NE(error_of([&] { split_matrix_chain(chain({momentum, make_builtin("skip_if_nonfinite"), matrix, lr})); })
                .find("skip"),
            std::string::npos);
  EXPECT_NO_THROW(split_matrix_chain(chain({make_builtin("unscale_by_grad_scale"), momentum, matrix, lr})));
  EXPECT_NE(error_of([&] { MatrixChainOptimizer(make_builtin("muon"), Backend::reference); }).find("reference"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_builtin("muon", {{"ns_steps", 100.0}}); }).find("steps"), std::string::npos);
  EXPECT_NE(error_of([&] { make_builtin("muon", {{"ns_coefficients", ArgValue(std::vector<double>{1, 2})}}); })
                .find("three numbers"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_builtin("muon", {{"adjust_lr", 3.0}}); }).find("adjust_lr"), std::string::npos);
  EXPECT_NE(error_of([&] { Rule("x").matrix_phase(ns).update([](RuleBuilder& b) { return b.update(); }); })
                .find("no update function"),
            std::string::npos);
  std::string why;
  if (!gemm_available(Backend::cpu, &why)) GTEST_SKIP() << why;
  MatrixChainOptimizer opt(make_builtin("muon"), Backend::cpu);
  std::vector<Matrix> ms = make_matrices({{6, 10}}, 6);
  new_gradients(ms, 7);
  std::vector<TensorRef> r = refs(ms);
  r[0].cols = 0;
  EXPECT_NE(error_of([&] { opt.set_tensors(r); }).find("matrix view"), std::string::npos);
  r[0].cols = 7;
  EXPECT_NE(error_of([&] { opt.set_tensors(r); }).find("matrix view"), std::string::npos);
  r = refs(ms);
  r[0].states.clear();
  EXPECT_NE(error_of([&] { opt.set_tensors(r); }).find("states"), std::string::npos);
  MatrixChainOptimizer moved(std::move(opt));
  EXPECT_NE(error_of([&] { opt.step(); }).find("moved from"), std::string::npos);
}

}  // namespace
}  // namespace optfuse
