// Schedule-free AdamW (rule schedule_free_adamw, named optimizer adamw_schedule_free) against the
// schedulefree package's AdamWScheduleFree step (train mode, the parameter is y) written out in
// plain double arithmetic:
//   sched = t / W while t - 1 < W, else 1;  lr_t = lr sched
//   v = b2 v + (1-b2) g^2;  gn = g / (sqrt(v / (1 - b2^t)) + eps) + wd y
//   y = y + ckp1 (z - y) + lr_t (b1 (1 - ckp1) - 1) gn;  z = z - lr_t gn
// with z starting as the parameter. First a few steps of one element against numbers derived by
// hand (below), then the rule_check harness (reference evaluator and CPU backend, every storage
// type, two groups, group 1 resuming).
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "ir/rule_check.h"

namespace optfuse::rulecheck {
namespace {

using G2 = std::array<double, 2>;

struct Trace {
  double y, z, v;
};

// One float32 element, param 1, stepped three times with gradients 1, 2, -1. `ckp1[i]` (if given)
// and `group_step[i]` (if given) are set before step i; `resume` is the step count before the first.
std::vector<Trace> run_one_element(const Chain& chain, std::vector<double> ckp1 = {},
                                   std::vector<double> group_step = {}, int64_t resume = 0) {
  OneElement e(chain);
  Optimizer& opt = e.optimizer();
  if (resume) opt.set_step_count(0, resume);
  auto at = [&](const std::string& name) { return e.state("schedule_free_adamw." + name); };
  EXPECT_EQ(at("z"), 1.0);  // z starts as the parameter
  std::vector<Trace> out;
  const float grads[] = {1.0f, 2.0f, -1.0f};
  for (size_t i = 0; i < 3; ++i) {
    if (i < ckp1.size()) opt.set_hyper(0, "ckp1", ckp1[i]);
    if (i < group_step.size()) opt.set_hyper(0, "group_step", group_step[i]);
    e.step(grads[i]);
    out.push_back({e.param(), at("z"), at("exp_avg_sq")});
  }
  return out;
}

// b1 = 0.5, b2 = 0.75, eps = 0, lr = 0.1, no warm-up or decay, ckp1 = 1/t (its default):
//   t=1: v = 0.25, 1 - b2 = 0.25, denom = sqrt(1) = 1, gn = 1; ckp1 = 1: lerp(y, z, 1) = z = 1;
//        y = 1 + 0.1 (0.5*0 - 1) 1 = 0.9; z = 1 - 0.1 = 0.9
//   t=2: v = 0.1875 + 1 = 1.1875, bc2 = 0.4375, sqrt(2.7142857) = 1.6475089, gn = 1.2139540;
//        ckp1 = 0.5: lerp(0.9, 0.9) = 0.9; coef 0.1 (0.25 - 1) = -0.075;
//        y = 0.9 - 0.0910466 = 0.8089535; z = 0.9 - 0.1213954 = 0.7786046
//   t=3: v = 0.890625 + 0.25 = 1.140625, bc2 = 0.578125, sqrt(1.9729730) = 1.4046257, gn = -0.7119335;
//        ckp1 = 1/3: lerp = 0.8089535 - 0.0303488/3 = 0.7988372; coef 0.1 (0.5*2/3 - 1) = -0.0666667;
//        y = 0.7988372 + 0.0474622 = 0.8462994; z = 0.7786046 + 0.0711934 = 0.8497980
TEST(ScheduleFreeAdamW, HandDerivedSteps) {
  auto t = run_one_element(parse_chain("adamw_schedule_free(lr=0.1, betas=(0.5, 0.75), eps=0.0)"));
  const double tol = 1e-6;
  EXPECT_NEAR(t[0].y, 0.9, tol);
  EXPECT_NEAR(t[0].z, 0.9, tol);
  EXPECT_NEAR(t[0].v, 0.25, tol);
  EXPECT_NEAR(t[1].v, 1.1875, tol);
  EXPECT_NEAR(t[1].y, 0.8089535, tol);
  EXPECT_NEAR(t[1].z, 0.7786046, tol);
  EXPECT_NEAR(t[2].v, 1.140625, tol);
  EXPECT_NEAR(t[2].y, 0.8462994, tol);
  EXPECT_NEAR(t[2].z, 0.8497980, tol);
}

// warmup_steps = 2, weight_decay = 0.5, and ckp1 as the reference computes it for r = 0,
// weight_lr_power = 2: lr_t = 0.05, 0.1, 0.1; weights lr_max^2 = 0.0025, 0.01, 0.01, sums 0.0025,
// 0.0125, 0.0225: ckp1 = 1, 0.8, 4/9.
//   t=1: gn = 1 + 0.5*1 = 1.5; y = 1 + 0.05 (0 - 1) 1.5 = 0.925; z = 1 - 0.075 = 0.925
//   t=2: gn = 1.2139540 + 0.5*0.925 = 1.6764540; lerp = 0.925; coef 0.1 (0.5*0.2 - 1) = -0.09;
//        y = 0.925 - 0.1508809 = 0.7741191; z = 0.925 - 0.1676454 = 0.7573546
//   t=3: gn = -0.7119335 + 0.5*0.7741191 = -0.3248739; lerp = 0.7741191 - 0.0167645*4/9 = 0.7666682;
//        coef 0.1 (0.5*5/9 - 1) = -0.0722222; y = 0.7666682 + 0.0234631 = 0.7901313;
//        z = 0.7573546 + 0.0324874 = 0.7898420
TEST(ScheduleFreeAdamW, HandDerivedWarmupDecayAndWeights) {
  const std::vector<double> ckp1 = {1.0, 0.8, 4.0 / 9.0};
  auto t = run_one_element(
      parse_chain("adamw_schedule_free(lr=0.1, betas=(0.5, 0.75), eps=0.0, weight_decay=0.5, warmup_steps=2)"), ckp1);
  const double tol = 1e-6;
  EXPECT_NEAR(t[0].y, 0.925, tol);
  EXPECT_NEAR(t[0].z, 0.925, tol);
  EXPECT_NEAR(t[1].y, 0.7741191, tol);
  EXPECT_NEAR(t[1].z, 0.7573546, tol);
  EXPECT_NEAR(t[2].y, 0.7901313, tol);
  EXPECT_NEAR(t[2].z, 0.7898420, tol);
}

// group_step > 0 is the step (bias correction, warm-up, the default ckp1) whatever the optimizer's
// own count is: the torch class counts steps per param group, as schedulefree does.
TEST(ScheduleFreeAdamW, GroupStepOverridesTheCount) {
  const Chain c = parse_chain("adamw_schedule_free(lr=0.1, betas=(0.5, 0.75), eps=0.0, warmup_steps=2)");
  auto a = run_one_element(c);
  auto b = run_one_element(c, {}, {1, 2, 3}, 7);
  auto d = run_one_element(c, {}, {}, 7);  // without it, the count of 7 is used: other values
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].y, b[i].y);
    EXPECT_EQ(a[i].z, b[i].z);
  }
  EXPECT_NE(a[0].y, d[0].y);
}

TEST(ScheduleFreeAdamW, Arguments) {
  EXPECT_EQ(builtin_parameter_names("adamw_schedule_free"),
            (std::vector<std::string>{"lr", "betas", "eps", "weight_decay", "warmup_steps"}));
  const Chain c = adamw_schedule_free();
  ASSERT_EQ(c.size(), 1u);
  auto hyper = [&](const std::string& n) {
    for (const HyperSpec& h : c[0].hypers())
      if (h.name == n) return h.value;
    return -99.0;
  };
  EXPECT_EQ(hyper("lr"), 0.0025);
  EXPECT_EQ(hyper("b1"), 0.9);
  EXPECT_EQ(hyper("b2"), 0.999);
  EXPECT_EQ(hyper("ckp1"), -1.0);
  EXPECT_EQ(hyper("group_step"), 0.0);
  ASSERT_EQ(c[0].states().size(), 2u);
  EXPECT_TRUE(c[0].states()[0].from_param);   // z
  EXPECT_FALSE(c[0].states()[1].from_param);  // exp_avg_sq
  Program p = build_program(c);
  EXPECT_TRUE(p.states[0].init_from_param);
  EXPECT_THROW(parse_chain("adamw_schedule_free(betas=(0.9, 1.0))"), Error);
  EXPECT_THROW(parse_chain("adamw_schedule_free(warmup_steps=-1)"), Error);
  EXPECT_THROW(parse_chain("adamw_schedule_free(r=1.0)"), Error);  // r lives in ckp1
  Optimizer o(c, Backend::reference, 1);
  EXPECT_THROW(o.set_hyper(0, "ckp1", 1.5), Error);
}

RuleCase sf_case(const std::string& spec, G2 lr, G2 wd, double b1, double b2, double eps, double warmup, int resume1,
                 int steps = 8) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"schedule_free_adamw.z", "schedule_free_adamw.exp_avg_sq"};
  c.steps = steps;
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    o.set_hyper(1, "weight_decay", wd[1]);
    o.set_step_count(1, resume1);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    const int k = x.group;
    const double t = x.t;
    const double lr_t = lr[k] * (t - 1 < warmup ? t / warmup : 1.0), ckp1 = 1.0 / t;
    s[1] = b2 * s[1] + (1 - b2) * g * g;
    const double gn = g / (std::sqrt(s[1] / (1 - std::pow(b2, t))) + eps) + wd[k] * p;
    p = p + ckp1 * (s[0] - p) + lr_t * (b1 * (1 - ckp1) - 1) * gn;
    s[0] = s[0] - lr_t * gn;
    return 0.0;
  };
  return c;
}

TEST(ScheduleFreeAdamW, Defaults) {
  run_everywhere(sf_case("adamw_schedule_free()", {0.0025, 0.005}, {0, 0}, 0.9, 0.999, 1e-8, 0, 5));
}
// A warm-up of 4 steps: group 0 runs through its end, group 1 resumes at 3; decay in both groups.
TEST(ScheduleFreeAdamW, WarmupWeightDecay) {
  run_everywhere(sf_case("adamw_schedule_free(lr=0.01, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1, warmup_steps=4)",
                         {0.01, 0.02}, {0.1, 0.3}, 0.8, 0.9, 1e-3, 4, 3));
}

}  // namespace
}  // namespace optfuse::rulecheck
