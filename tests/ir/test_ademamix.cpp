// AdEMAMix (rule scale_by_ademamix, named optimizer ademamix) against the paper's Algorithm 1
// (Pagliardini, Ablin, Grangier 2024) written out in plain double arithmetic, with the warm-up
// schedulers of its appendix / reference implementation (apple/ml-ademamix):
//   alpha_t = (t / T_alpha) alpha while t < T_alpha, else alpha
//   b3_t    = f^-1((1 - a) f(b1) + a f(b3)), a = t / T_beta3, while t < T_beta3, else b3
//   f(b) = ln(0.5) / ln(b + 1e-8) - 1,  f^-1(x) = 0.5^(1 / (x + 1))
//   m1 = b1 m1 + (1-b1) g; m2 = b3_t m2 + (1-b3_t) g; nu = b2 nu + (1-b2) g^2
//   p -= lr ((m1 / (1-b1^t) + alpha_t m2) / (sqrt(nu) / sqrt(1-b2^t) + eps) + wd p)
// First a few steps of one element against numbers derived by hand (below), then the rule_check
// harness (reference evaluator and CPU backend, every storage type, two groups, group 1 resuming).
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "ir/rule_check.h"

namespace optfuse::rulecheck {
namespace {

using G2 = std::array<double, 2>;

double half_life(double b) { return std::log(0.5) / std::log(b + 1e-8) - 1; }

double alpha_at(double t, double alpha, double t_alpha) { return t < t_alpha ? t / t_alpha * alpha : alpha; }

double beta3_at(double t, double b1, double b3, double t_beta3) {
  if (!(t < t_beta3)) return b3;
  double a = t / t_beta3;
  return std::pow(0.5, 1 / ((1 - a) * half_life(b1) + a * half_life(b3) + 1));
}

// One float32 element stepped three times with gradients 1, 2, -1; param 1.
// b1 = 0.5, b2 = 0.75, b3 = 0.9, alpha = 2, eps = 0, lr = 0.1.
// Without warm-up or decay, by hand:
//   t=1: m1 = 0.5, m2 = 0.1, nu = 0.25; m1/(1-0.5) = 1, sqrt(0.25)/sqrt(0.25) = 1;
//        update = (1 + 2*0.1) / 1 = 1.2, p = 1 - 0.12 = 0.88
//   t=2: m1 = 0.25 + 1 = 1.25, m2 = 0.09 + 0.2 = 0.29, nu = 0.1875 + 1 = 1.1875;
//        update = (1.25/0.75 + 0.58) / sqrt(1.1875/0.4375) = 2.246667 / 1.647509 = 1.363675,
//        p = 0.88 - 0.1363675 = 0.7436325
//   t=3: m1 = 0.625 - 0.5 = 0.125, m2 = 0.261 - 0.1 = 0.161, nu = 0.890625 + 0.25 = 1.140625;
//        p = 0.7105378
// With t_alpha = t_beta3 = 4 and weight_decay = 0.5:
//   t=1: alpha_1 = 0.5; f(0.5) = 0 (to 1e-8), f(0.9) = 5.578837, a = 0.25:
//        b3_1 = 0.5^(1/(1.394709 + 1)) = 0.748675; m2 = 0.251325;
//        update = 1 + 0.5*0.251325 = 1.125662, p = 1 - 0.1*(1.125662 + 0.5) = 0.837434
//   t=2: alpha_2 = 1, b3_2 = 0.832837, m2 = 0.543638, p = 0.661402
//   t=3: alpha_3 = 1.5, b3_3 = 0.874847, m2 = 0.350448, p = 0.580737
struct Trace {
  double p, m1, m2, nu;
};

std::vector<Trace> run_one_element(const Chain& chain) {
  OneElement e(chain);
  auto at = [&](const std::string& name) { return e.state("scale_by_ademamix." + name); };
  std::vector<Trace> out;
  for (float grad : {1.0f, 2.0f, -1.0f}) {
    e.step(grad);
    out.push_back({e.param(), at("exp_avg_fast"), at("exp_avg_slow"), at("exp_avg_sq")});
  }
  return out;
}

TEST(AdEMAMix, HandDerivedSteps) {
  auto t = run_one_element(
      parse_chain("ademamix(lr=0.1, betas=(0.5, 0.75, 0.9), alpha=2.0, eps=0.0)"));
  const double tol = 1e-6;
  EXPECT_NEAR(t[0].p, 0.88, tol);
  EXPECT_NEAR(t[0].m1, 0.5, tol);
  EXPECT_NEAR(t[0].m2, 0.1, tol);
  EXPECT_NEAR(t[0].nu, 0.25, tol);
  EXPECT_NEAR(t[1].p, 0.7436325, tol);
  EXPECT_NEAR(t[1].m2, 0.29, tol);
  EXPECT_NEAR(t[1].nu, 1.1875, tol);
  EXPECT_NEAR(t[2].p, 0.7105378, tol);
  EXPECT_NEAR(t[2].m1, 0.125, tol);
  EXPECT_NEAR(t[2].m2, 0.161, tol);
}

TEST(AdEMAMix, HandDerivedWarmupAndDecay) {
  auto t = run_one_element(parse_chain(
      "ademamix(lr=0.1, b1=0.5, b2=0.75, b3=0.9, alpha=2.0, t_alpha=4, t_beta3=4, eps=0.0, weight_decay=0.5)"));
  const double tol = 1e-6;
  EXPECT_NEAR(t[0].m2, 0.251325, tol);
  EXPECT_NEAR(t[0].p, 0.837434, tol);
  EXPECT_NEAR(t[1].m2, 0.543638, tol);
  EXPECT_NEAR(t[1].p, 0.661402, tol);
  EXPECT_NEAR(t[2].m2, 0.350448, tol);
  EXPECT_NEAR(t[2].p, 0.580737, tol);
  // The schedulers as written above, against the same hand numbers.
  EXPECT_NEAR(beta3_at(1, 0.5, 0.9, 4), 0.748675, 1e-6);
  EXPECT_NEAR(beta3_at(3, 0.5, 0.9, 4), 0.874847, 1e-6);
  EXPECT_EQ(beta3_at(4, 0.5, 0.9, 4), 0.9);
  EXPECT_EQ(alpha_at(2, 2.0, 4), 1.0);
}

// T = 0 is "no warm-up" (the reference's None), and so is T <= t.
TEST(AdEMAMix, ZeroWarmupIsNone) {
  auto a = run_one_element(parse_chain("ademamix(lr=0.1, betas=(0.5, 0.75, 0.9), eps=0.0)"));
  auto b = run_one_element(parse_chain("ademamix(lr=0.1, betas=(0.5, 0.75, 0.9), eps=0.0, t_alpha=0, t_beta3=0)"));
  auto c = run_one_element(parse_chain("ademamix(lr=0.1, betas=(0.5, 0.75, 0.9), eps=0.0, t_alpha=1, t_beta3=1)"));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].p, b[i].p);
    EXPECT_EQ(a[i].p, c[i].p);
  }
}

TEST(AdEMAMix, Arguments) {
  // betas is a triple; the names, defaults and the b1=/b2=/b3= alternative.
  EXPECT_EQ(builtin_parameter_names("ademamix"),
            (std::vector<std::string>{"lr", "betas", "alpha", "t_beta3", "t_alpha", "eps", "weight_decay"}));
  EXPECT_EQ(ademamix().size(), 2u);  // no weight decay rule at weight_decay = 0
  EXPECT_EQ(ademamix({{"weight_decay", 0.1}}).size(), 3u);
  auto hyper = [](const Chain& c, const std::string& n) {
    for (const Rule& r : c)
      for (const HyperSpec& h : r.hypers())
        if (h.name == n) return h.value;
    return -1.0;
  };
  EXPECT_EQ(hyper(ademamix(), "b3"), 0.9999);
  EXPECT_EQ(hyper(ademamix(), "alpha"), 2.0);
  EXPECT_EQ(hyper(ademamix({{"b3", 0.99}}), "b3"), 0.99);
  EXPECT_EQ(hyper(parse_chain("ademamix(betas=(0.8, 0.9, 0.95))"), "b3"), 0.95);
  EXPECT_THROW(parse_chain("ademamix(betas=(0.9, 0.999))"), Error);
  EXPECT_THROW(parse_chain("adam(betas=(0.9, 0.999, 0.9999))"), Error);
  EXPECT_THROW(parse_chain("adam(b3=0.9)"), Error);
  EXPECT_THROW(parse_chain("ademamix(betas=(0.9, 0.999, 1.0))"), Error);
  EXPECT_THROW(parse_chain("ademamix(t_alpha=-1)"), Error);
  try {
    parse_chain("ademamix(betas=(0.9, 0.999))");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("betas must be three numbers, got 2"), std::string::npos) << e.what();
  }
}

RuleCase ademamix_case(const std::string& spec, G2 lr, G2 wd, double b1, double b2, double b3, double alpha,
                       double t_alpha, double t_beta3, double eps, int resume1, int steps = 8) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_ademamix.exp_avg_fast", "scale_by_ademamix.exp_avg_slow", "scale_by_ademamix.exp_avg_sq"};
  c.steps = steps;
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    if (wd[0] != 0) o.set_hyper(1, "weight_decay", wd[1]);
    o.set_step_count(1, resume1);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    double t = x.t;
    double a_t = alpha_at(t, alpha, t_alpha), b3_t = beta3_at(t, b1, b3, t_beta3);
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = b3_t * s[1] + (1 - b3_t) * g;
    s[2] = b2 * s[2] + (1 - b2) * g * g;
    double update = (s[0] / (1 - std::pow(b1, t)) + a_t * s[1]) / (std::sqrt(s[2]) / std::sqrt(1 - std::pow(b2, t)) + eps);
    p -= lr[k] * (update + wd[k] * p);
    return 0.0;
  };
  return c;
}

TEST(AdEMAMix, Defaults) {
  run_everywhere(ademamix_case("ademamix()", {1e-3, 2e-3}, {0, 0}, 0.9, 0.999, 0.9999, 2.0, 0, 0, 1e-8, 5));
}
// Warm-ups over 6 steps: group 0 runs through the end of both (steps 1..8), group 1 resumes at 3.
TEST(AdEMAMix, WarmupWeightDecay) {
  run_everywhere(ademamix_case(
      "ademamix(lr=0.01, betas=(0.8, 0.9, 0.99), alpha=5.0, t_alpha=6, t_beta3=6, eps=1e-3, weight_decay=0.1)",
      {0.01, 0.02}, {0.1, 0.3}, 0.8, 0.9, 0.99, 5.0, 6, 6, 1e-3, 3));
}
// Different warm-up lengths, b1 = 0 (the reference keeps no fast EMA then: m1 = g, the same math).
TEST(AdEMAMix, SeparateWarmupsZeroBeta1) {
  run_everywhere(ademamix_case("ademamix(lr=0.01, betas=(0.0, 0.9, 0.999), t_alpha=3, t_beta3=10, eps=1e-3)",
                               {0.01, 0.005}, {0, 0}, 0.0, 0.9, 0.999, 2.0, 3, 10, 1e-3, 0));
}

}  // namespace
}  // namespace optfuse::rulecheck
