// Uniform states (Rule::uniform_state: one float64 per parameter group, kept across steps), checked
// against values derived by hand on the reference evaluator and the CPU backend: the value read
// during a step is the old one, the new one is committed only where the step is not skipped
// (skip_if_nonfinite, found_inf), add_group keeps existing groups' values, a uniform state may
// depend on a global reduction (two passes), NAdam's mu_product follows torch's float32 product and
// ASGD's eta and mu torch's float32 scalars.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"

namespace optfuse {
namespace {

// acc starts at 2; each step acc <- acc * f + t (t the step taken); update = -(old acc) * g.
Rule accumulating(double f = 0.5) {
  Rule r("accumulate");
  r.hyper("f", f);
  r.uniform_state("acc", 2.0);
  r.update([](RuleBuilder& b) {
    Expr acc = b.uniform_state("acc");
    b.set_uniform_state("acc", acc * b.hyper("f") + b.step());
    return -acc * b.update();
  });
  return r;
}

struct One {  // one parameter of n elements, gradient g everywhere
  std::vector<float> p, g;
  One(size_t n, float p0, float g0) : p(n, p0), g(n, g0) {}
  TensorRef ref(int group = 0) {
    TensorRef t;
    t.param = {p.data(), static_cast<int64_t>(p.size()), DType::f32};
    t.grad = {g.data(), static_cast<int64_t>(g.size()), DType::f32};
    t.group = group;
    return t;
  }
};

class UniformState : public ::testing::TestWithParam<Backend> {};

TEST_P(UniformState, ReadsTheOldValueAndCommitsTheNewOneEachStep) {
  Optimizer opt({accumulating()}, GetParam(), 2);
  opt.set_hyper(1, "f", 2.0);
  One a(3, 10.0f, 1.0f), b(40000, 10.0f, 1.0f);  // b: several CPU chunks
  opt.set_tensors({a.ref(0), b.ref(1)});
  EXPECT_EQ(opt.uniform_state(0, "acc"), 2.0);
  EXPECT_EQ(opt.uniform_state(1, "accumulate.acc"), 2.0);
  // group 0 (f = 0.5): acc 2 -> 2 -> 3 -> 4.5; group 1 (f = 2): acc 2 -> 5 -> 12 -> 27
  double acc0 = 2, acc1 = 2, p0 = 10, p1 = 10;
  for (int t = 1; t <= 3; ++t) {
    opt.step();
    p0 -= acc0;  // the value read during the step is the one before it
    p1 -= acc1;
    acc0 = acc0 * 0.5 + t;
    acc1 = acc1 * 2.0 + t;
    EXPECT_EQ(opt.uniform_state(0, "acc"), acc0) << "step " << t;
    EXPECT_EQ(opt.uniform_state(1, "acc"), acc1) << "step " << t;
    EXPECT_EQ(a.p[2], static_cast<float>(p0)) << "step " << t;
    EXPECT_EQ(b.p[39999], static_cast<float>(p1)) << "step " << t;
  }
  EXPECT_EQ(acc0, 4.5);
  EXPECT_EQ(acc1, 27.0);
}

TEST_P(UniformState, NotCommittedOnASkippedStep) {
  Chain c = chain({make_builtin("unscale_by_grad_scale"), make_builtin("skip_if_nonfinite"), Chain{accumulating()}});
  Optimizer opt(c, GetParam());
  One a(4, 10.0f, 1.0f);
  opt.set_tensors({a.ref()});
  opt.step();  // acc 2 -> 2, p 10 -> 8
  EXPECT_EQ(opt.uniform_state(0, "acc"), 2.0);
  // found_inf (a GradScaler's overflow): nothing changes
  float scale = 1.0f, inf = 1.0f;
  StepInputs in;
  in.grad_scale = &scale;
  in.found_inf = &inf;
  opt.step(in);
  EXPECT_EQ(opt.step_count(0), 1);
  EXPECT_EQ(opt.uniform_state(0, "acc"), 2.0);
  EXPECT_EQ(a.p[0], 8.0f);
  // a non-finite gradient (skip_if_nonfinite): nothing changes either
  a.g[3] = INFINITY;
  opt.step();
  EXPECT_EQ(opt.step_count(0), 1);
  EXPECT_EQ(opt.uniform_state(0, "acc"), 2.0);
  EXPECT_EQ(a.p[0], 8.0f);
  // the next step that is taken is step 2: acc 2 -> 2 * 0.5 + 2 = 3, p 8 -> 6
  a.g[3] = 1.0f;
  opt.step();
  EXPECT_EQ(opt.step_count(0), 2);
  EXPECT_EQ(opt.uniform_state(0, "acc"), 3.0);
  EXPECT_EQ(a.p[0], 6.0f);
}

TEST_P(UniformState, AddGroupKeepsValuesAndSetUniformStateSeedsTheNextStep) {
  Optimizer opt({accumulating()}, GetParam());
  One a(2, 0.0f, 1.0f);
  opt.set_tensors({a.ref()});
  opt.step();
  opt.step();  // acc 2 -> 2 -> 3
  EXPECT_EQ(opt.uniform_state(0, "acc"), 3.0);
  EXPECT_EQ(opt.add_group(), 1);
  EXPECT_EQ(opt.uniform_state(0, "acc"), 3.0);
  EXPECT_EQ(opt.step_count(0), 2);
  EXPECT_EQ(opt.uniform_state(1, "acc"), 2.0);  // the init value
  opt.set_uniform_state(1, "acc", 7.0);
  One b(2, 0.0f, 1.0f);
  opt.set_tensors({a.ref(0), b.ref(1)});
  opt.step();
  EXPECT_EQ(b.p[0], -7.0f);                     // group 1's step read the value set
  EXPECT_EQ(opt.uniform_state(1, "acc"), 4.5);  // 7 * 0.5 + 1 (its first step)
  EXPECT_EQ(opt.uniform_state(0, "acc"), 4.5);  // 3 * 0.5 + 3
  EXPECT_THROW(opt.uniform_state(0, "nope"), Error);
  EXPECT_THROW(opt.uniform_state(2, "acc"), Error);
}

TEST_P(UniformState, MayDependOnAGlobalReduction) {
  // acc <- acc + ||g||^2 (global): the new value needs the reduce pass; the update reads the old value.
  Rule r("sum_norms");
  r.uniform_state("acc", 0.0);
  r.update([](RuleBuilder& b) {
    Expr acc = b.uniform_state("acc");
    b.set_uniform_state("acc", acc + global_sum_of_squares(b.update()));
    return -(acc + 1.0) * b.update();
  });
  Optimizer opt({r}, GetParam());
  ASSERT_EQ(opt.plan().phases.size(), 2u);
  One a(3, 0.0f, 2.0f);  // ||g||^2 = 12
  opt.set_tensors({a.ref()});
  opt.step();
  EXPECT_EQ(opt.uniform_state(0, "acc"), 12.0);
  EXPECT_EQ(a.p[0], -2.0f);
  opt.step();
  EXPECT_EQ(opt.uniform_state(0, "acc"), 24.0);
  EXPECT_EQ(a.p[0], -2.0f - 13.0f * 2.0f);
}

// torch.optim.NAdam's _single_tensor_nadam for one element, in float32 where torch's tensors are
// (param, grad, moments, mu_product) and float64 where its Python scalars are.
struct NadamRef {
  double lr = 2e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, psi = 4e-3;
  float p, m = 0, v = 0, mu_product = 1;
  int t = 0;
  explicit NadamRef(float p0) : p(p0) {}
  void step(float g) {
    ++t;
    double bc2 = 1 - std::pow(b2, t);
    double mu = b1 * (1.0 - 0.5 * std::pow(0.96, t * psi));
    double mu_next = b1 * (1.0 - 0.5 * std::pow(0.96, (t + 1) * psi));
    mu_product = mu_product * static_cast<float>(mu);
    float w = static_cast<float>(1 - b1);
    m = m + w * (g - m);  // lerp with |w| < 0.5
    v = v * static_cast<float>(b2) + static_cast<float>(1 - b2) * g * g;
    float denom = std::sqrt(v / static_cast<float>(bc2)) + static_cast<float>(eps);
    double mp_next = static_cast<double>(mu_product) * mu_next;
    p = p + static_cast<float>(-lr * (1.0 - mu) / (1.0 - mu_product)) * g / denom;
    p = p + static_cast<float>((-lr * mu_next) / (1.0 - mp_next)) * m / denom;
  }
};

TEST_P(UniformState, NadamMatchesTorchsFormulasAndKeepsMuProductPerGroup) {
  Optimizer opt(make_builtin("nadam"), GetParam(), 2);
  std::vector<float> p0{1.0f, -0.5f}, g0(2), m0(2, 0.0f), v0(2, 0.0f);
  std::vector<float> p1{0.25f}, g1(1), m1(1, 0.0f), v1(1, 0.0f);
  TensorRef a{{p0.data(), 2, DType::f32}, {g0.data(), 2, DType::f32}, {{m0.data(), 2}, {v0.data(), 2}}, 0};
  TensorRef b{{p1.data(), 1, DType::f32}, {g1.data(), 1, DType::f32}, {{m1.data(), 1}, {v1.data(), 1}}, 1};
  opt.set_tensors({a, b});
  NadamRef r0(1.0f), r1(-0.5f), r2(0.25f);
  float mp1 = 1.0f;  // group 1 steps only from step 3 on
  for (int s = 0; s < 6; ++s) {
    float ga = 0.3f - 0.1f * static_cast<float>(s), gb = -0.2f + 0.05f * static_cast<float>(s);
    g0 = {ga, gb};
    g1 = {0.7f};
    if (s == 2) opt.set_step_count(1, 0);
    opt.step();
    r0.step(ga);
    r1.step(gb);
    if (s >= 2) r2.step(0.7f);
    else p1[0] = 0.25f, m1[0] = 0.0f, v1[0] = 0.0f, opt.set_uniform_state(1, "mu_product", 1.0);
    EXPECT_NEAR(p0[0], r0.p, 1e-7) << "step " << s;
    EXPECT_NEAR(p0[1], r1.p, 1e-7) << "step " << s;
    EXPECT_EQ(opt.uniform_state(0, "mu_product"), static_cast<double>(r0.mu_product)) << "step " << s;
    if (s >= 2) {
      mp1 = r2.mu_product;
      EXPECT_NEAR(p1[0], r2.p, 1e-7) << "step " << s;
      EXPECT_EQ(opt.uniform_state(1, "mu_product"), static_cast<double>(mp1)) << "step " << s;
    }
  }
  EXPECT_LT(r0.mu_product, 0.5f);
}

// torch.optim.ASGD's _single_tensor_asgd for one element: eta and mu in float32 tensors, set at the
// end of each step from that step's lr, lambd, alpha and t0 (float64 Python math); the step uses the
// old ones (eta_value = eta.item(); p.mul_(1 - lambd * eta_value); p.add_(g, alpha=-eta_value)).
struct AsgdRef {
  double lr = 0.05, lambd = 0.3, alpha = 0.6, t0 = 2;
  float p, ax = 0, eta, mu = 1;
  int t = 0;
  explicit AsgdRef(float p0) : p(p0), eta(static_cast<float>(lr)) {}
  void step(float g) {
    ++t;
    double e = eta;
    p = p * static_cast<float>(1 - lambd * e);
    p = p + static_cast<float>(-e) * g;
    ax = mu != 1.0f ? ax + (p - ax) * mu : p;
    eta = static_cast<float>(lr / std::pow(1 + lambd * lr * t, alpha));
    mu = static_cast<float>(1 / std::max(1.0, t - t0));
  }
};

// ASGD's eta and mu are uniform states: each step reads the values the previous one left (so a
// changed lr, lambd or t0 reaches eta and mu one step later, as in torch) and a skipped step keeps them.
TEST_P(UniformState, AsgdEtaAndMuFollowTorchThroughHyperparameterChangesAndSkips) {
  AsgdRef r(0.75f);
  Chain c = chain({make_builtin("unscale_by_grad_scale"),
                   make_builtin("asgd", {{"lr", r.lr}, {"lambd", r.lambd}, {"alpha", r.alpha}, {"t0", r.t0}})});
  Optimizer opt(c, GetParam());
  std::vector<float> p{0.75f}, g{0.0f}, ax{0.0f};
  TensorRef a{{p.data(), 1, DType::f32}, {g.data(), 1, DType::f32}, {{ax.data(), 1}}, 0};
  opt.set_tensors({a});
  float scale = 1.0f, found = 0.0f;
  StepInputs in;
  in.grad_scale = &scale;
  in.found_inf = &found;
  for (int s = 0; s < 10; ++s) {
    float grad = 0.4f - 0.15f * static_cast<float>(s);
    g[0] = grad;
    if (s == 3) r.lr = 0.02, opt.set_hyper(0, "lr", r.lr);         // a scheduler
    if (s == 5) r.lambd = 0.1, opt.set_hyper(0, "lambd", r.lambd);  // and a hand edit
    if (s == 6) r.t0 = 1, opt.set_hyper(0, "t0", r.t0);
    found = s == 7 ? 1.0f : 0.0f;  // a GradScaler's overflow: torch does not step at all
    opt.step(in);
    if (s != 7) r.step(grad);
    if (GetParam() == Backend::cpu) {  // float32 element math, rounded as torch's: bitwise
      EXPECT_EQ(p[0], r.p) << "step " << s;
      EXPECT_EQ(ax[0], r.ax) << "step " << s;
    } else {  // the reference evaluator's element math is float64
      EXPECT_NEAR(p[0], r.p, 1e-7) << "step " << s;
      EXPECT_NEAR(ax[0], r.ax, 1e-7) << "step " << s;
    }
    EXPECT_EQ(opt.uniform_state(0, "eta"), static_cast<double>(r.eta)) << "step " << s;
    EXPECT_EQ(opt.uniform_state(0, "mu"), static_cast<double>(r.mu)) << "step " << s;
  }
  EXPECT_EQ(opt.step_count(0), 9);
  EXPECT_LT(r.mu, 1.0f);  // averaging has started
}

INSTANTIATE_TEST_SUITE_P(Backends, UniformState, ::testing::Values(Backend::reference, Backend::cpu),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(UniformStatePlan, RefusesPerElementValuesAndShowsInExplain) {
  Rule bad("bad");
  bad.uniform_state("acc", 0.0);
  bad.update([](RuleBuilder& b) {
    b.set_uniform_state("acc", b.update());
    return b.update();
  });
  EXPECT_THROW(build_program({bad}), Error);
  Rule per_tensor("per_tensor");
  per_tensor.uniform_state("acc", 0.0);
  per_tensor.update([](RuleBuilder& b) {
    b.set_uniform_state("acc", tensor_sum_of_squares(b.update()));
    return b.update();
  });
  EXPECT_THROW(make_plan({per_tensor}), Error);
  Rule twice("twice");
  twice.uniform_state("acc");
  EXPECT_THROW(twice.uniform_state("acc"), Error);
  Plan plan = make_plan(make_builtin("nadam"));
  EXPECT_EQ(plan.layout.uniform_states_per_group, 1);
  std::string text = plan.describe();
  EXPECT_NE(text.find("scale_by_nadam.mu_product (init 1) <- mu_product_new"), std::string::npos) << text;
  EXPECT_NE(text.find("commit the step count and uniform states"), std::string::npos) << text;
  // layout: ustate[G x S] between skip[G] and derived[G x D]
  EXPECT_EQ(plan.layout.uniform_states_offset(3), plan.layout.skip_offset(3) + 3);
  EXPECT_EQ(plan.layout.derived_offset(3), plan.layout.uniform_states_offset(3) + 3);
}

}  // namespace
}  // namespace optfuse
