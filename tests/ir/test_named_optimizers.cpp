// The named optimizers (torch.optim's argument names and defaults) against torch's documented
// algorithms, written out below in plain double arithmetic as the torch.optim docs state them
// (where docs and implementation differ, the implementation, as noted). Each runs with its options
// (maximize, weight_decay, momentum, nesterov, amsgrad, centered, lr_decay...) on the reference
// evaluator and the CPU backend, every storage type, two groups with different lr and weight_decay.
// rule_check.h explains the per-step check and its tolerance.
#include <gtest/gtest.h>

#include <array>

#include "ir/rule_check.h"

namespace optfuse::rulecheck {
namespace {

using G2 = std::array<double, 2>;

// Group 1 gets its own lr and (when the chain has one) weight_decay.
std::function<void(Optimizer&)> group1(double lr, double wd = -1) {
  return [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr);
    if (wd >= 0) o.set_hyper(1, "weight_decay", wd);
  };
}

// torch.optim.SGD: g <- -g if maximize; g <- g + wd p; with momentum b = g on the first step, then
// b = mu b + (1 - dampening) g, and g <- g + mu b (nesterov) or b; p <- p - lr g.
RuleCase sgd_case(const std::string& spec, G2 lr, G2 wd, double mu, double damp, bool nesterov, bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  if (mu != 0) c.states = {"trace.momentum_buffer"};
  c.configure = group1(lr[1], wd[0] != 0 ? wd[1] : -1);
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    g += wd[k] * p;
    if (mu != 0) {
      s[0] = x.t == 1 ? g : mu * s[0] + (1 - damp) * g;
      g = nesterov ? g + mu * s[0] : s[0];
    }
    p -= lr[k] * g;
    return 0.0;
  };
  return c;
}

TEST(NamedOptimizers, SgdPlain) { run_everywhere(sgd_case("sgd(lr=0.1)", {0.1, 0.05}, {0, 0}, 0, 0, false, false)); }
TEST(NamedOptimizers, SgdMomentumDampeningWeightDecay) {
  run_everywhere(sgd_case("sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)", {0.1, 0.05}, {0.01, 0.1},
                          0.9, 0.1, false, false));
}
TEST(NamedOptimizers, SgdNesterovMaximize) {
  run_everywhere(sgd_case("sgd(lr=0.05, momentum=0.8, nesterov=true, maximize=true, weight_decay=0.2)",
                          {0.05, 0.02}, {0.2, 0.0}, 0.8, 0, true, true));
}

// torch.optim.Adam / AdamW: g <- -g if maximize; Adam adds wd p to g, AdamW multiplies p by
// (1 - lr wd) first; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; with amsgrad v_max = max(v_max, v)
// (torch's implementation keeps the max of the uncorrected v; the docs write it of v_hat);
// p <- p - lr (m / (1-b1^t)) / (sqrt(v or v_max) / sqrt(1-b2^t) + eps).
RuleCase adam_case(const std::string& spec, bool decoupled, G2 lr, G2 wd, double b1, double b2, double eps,
                   bool amsgrad, bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_adam.exp_avg", "scale_by_adam.exp_avg_sq"};
  if (amsgrad) c.states.push_back("scale_by_adam.max_exp_avg_sq");
  c.configure = group1(lr[1], wd[0] != 0 ? wd[1] : -1);
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    if (decoupled) {
      p *= 1 - lr[k] * wd[k];
    } else {
      g += wd[k] * p;
    }
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = b2 * s[1] + (1 - b2) * g * g;
    double v = s[1];
    if (amsgrad) v = s[2] = std::max(s[2], s[1]);
    double denom = std::sqrt(v) / std::sqrt(1 - std::pow(b2, x.t)) + eps;
    p -= lr[k] / (1 - std::pow(b1, x.t)) * s[0] / denom;
    return 0.0;
  };
  return c;
}

TEST(NamedOptimizers, AdamWeightDecay) {
  run_everywhere(adam_case("adam(lr=0.1, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)", false, {0.1, 0.05},
                           {0.1, 0.0}, 0.8, 0.95, 1e-3, false, false));
}
TEST(NamedOptimizers, AdamDefaultsNoWeightDecay) {
  run_everywhere(adam_case("adam()", false, {1e-3, 0.2}, {0, 0}, 0.9, 0.999, 1e-8, false, false));
}
TEST(NamedOptimizers, AdamAmsgradMaximize) {
  run_everywhere(adam_case("adam(lr=0.1, b1=0.7, b2=0.9, amsgrad=true, maximize=true)", false, {0.1, 0.3},
                           {0, 0}, 0.7, 0.9, 1e-8, true, true));
}
TEST(NamedOptimizers, AdamwDefaultWeightDecay) {
  // adamw's default weight_decay is 1e-2 (torch's), unlike adam's 0.
  run_everywhere(adam_case("adamw(lr=0.1)", true, {0.1, 0.05}, {1e-2, 0.5}, 0.9, 0.999, 1e-8, false, false));
}
TEST(NamedOptimizers, AdamwAmsgradMaximize) {
  run_everywhere(adam_case("adamw(lr=0.1, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.3, amsgrad=true, maximize=true)",
                           true, {0.1, 0.02}, {0.3, 0.1}, 0.8, 0.9, 1e-4, true, true));
}

// Lion (Chen et al. 2023, Algorithm 2; lion-pytorch): p <- p (1 - lr wd);
// p <- p - lr sign(b1 m + (1-b1) g); m <- b2 m + (1-b2) g.
TEST(NamedOptimizers, LionWeightDecay) {
  RuleCase c;
  G2 lr{0.1, 0.05}, wd{0.5, 0.1};
  const double b1 = 0.8, b2 = 0.95;
  c.name = "lion";
  c.chain = lion({{"lr", 0.1}, {"betas", {0.8, 0.95}}, {"weight_decay", 0.5}});
  c.states = {"scale_by_lion.exp_avg"};
  c.configure = group1(lr[1], wd[1]);
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    double a = b1 * s[0], b = (1 - b1) * g, dir = a + b;
    p = p * (1 - lr[k] * wd[k]) - lr[k] * sgn(dir);
    s[0] = b2 * s[0] + (1 - b2) * g;
    return std::fabs(dir) <= 1e-5 * (std::fabs(a) + std::fabs(b)) ? 2 * lr[k] : 0.0;
  };
  run_everywhere(c);
}

// torch.optim.RMSprop: g <- -g if maximize; g <- g + wd p; sq = alpha sq + (1-alpha) g^2;
// centered: ga = alpha ga + (1-alpha) g, avg = sqrt(sq - ga^2) + eps, else sqrt(sq) + eps;
// momentum > 0: b = mu b + g / avg (b starts at 0), p <- p - lr b; else p <- p - lr g / avg.
RuleCase rmsprop_case(const std::string& spec, G2 lr, G2 wd, double alpha, double eps, double mu, bool centered,
                      bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_rms.square_avg"};
  if (centered) c.states.push_back("scale_by_rms.grad_avg");
  if (mu != 0) c.states.push_back("trace.momentum_buffer");
  c.configure = group1(lr[1], wd[0] != 0 ? wd[1] : -1);
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    g += wd[k] * p;
    s[0] = alpha * s[0] + (1 - alpha) * g * g;
    double var = s[0];
    if (centered) {
      s[1] = alpha * s[1] + (1 - alpha) * g;
      var -= s[1] * s[1];
    }
    double step = g / (std::sqrt(var) + eps);
    if (mu != 0) {
      double& b = s[centered ? 2 : 1];
      b = mu * b + step;
      step = b;
    }
    p -= lr[k] * step;
    return 0.0;
  };
  return c;
}

TEST(NamedOptimizers, RmspropPlain) {
  run_everywhere(rmsprop_case("rmsprop(lr=0.01)", {0.01, 0.03}, {0, 0}, 0.99, 1e-8, 0, false, false));
}
TEST(NamedOptimizers, RmspropCenteredMomentumWeightDecayMaximize) {
  run_everywhere(rmsprop_case("rmsprop(lr=0.02, alpha=0.9, eps=1e-3, weight_decay=0.05, momentum=0.5, "
                              "centered=true, maximize=true)",
                              {0.02, 0.01}, {0.05, 0.2}, 0.9, 1e-3, 0.5, true, true));
}

// torch.optim.Adagrad: g <- -g if maximize; g <- g + wd p; clr = lr / (1 + (t-1) lr_decay);
// sum += g^2 (sum starts at initial_accumulator_value); p <- p - clr g / (sqrt(sum) + eps).
RuleCase adagrad_case(const std::string& spec, G2 lr, G2 wd, double decay, double eps, bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_adagrad.sum"};
  c.configure = group1(lr[1], wd[0] != 0 ? wd[1] : -1);
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    g += wd[k] * p;
    double clr = lr[k] / (1 + (x.t - 1) * decay);
    s[0] += g * g;
    p -= clr * g / (std::sqrt(s[0]) + eps);
    return 0.0;
  };
  return c;
}

TEST(NamedOptimizers, AdagradPlain) {
  run_everywhere(adagrad_case("adagrad()", {1e-2, 0.1}, {0, 0}, 0, 1e-10, false));
}
TEST(NamedOptimizers, AdagradDecayInitWeightDecayMaximize) {
  run_everywhere(adagrad_case("adagrad(lr=0.1, lr_decay=0.3, weight_decay=0.1, initial_accumulator_value=0.5, "
                              "eps=1e-4, maximize=true)",
                              {0.1, 0.2}, {0.1, 0.0}, 0.3, 1e-4, true));
}

// The named optimizers are the documented chains of rules, in this order.
TEST(NamedOptimizers, ChainsAreTheDocumentedRules) {
  auto names = [](const Chain& c) {
    std::string s;
    for (const Rule& r : c) s += (s.empty() ? "" : " ") + r.name();
    return s;
  };
  EXPECT_EQ(names(sgd()), "scale_by_learning_rate");
  EXPECT_EQ(names(sgd({{"momentum", 0.9}, {"weight_decay", 0.1}, {"maximize", true}})),
            "scale add_decayed_weights trace scale_by_learning_rate");
  EXPECT_EQ(names(adam({{"weight_decay", 0.1}})), "add_decayed_weights scale_by_adam scale_by_learning_rate");
  EXPECT_EQ(names(adamw()), "scale_by_adam decoupled_weight_decay scale_by_learning_rate");
  EXPECT_EQ(names(lion({{"weight_decay", 0.1}})), "scale_by_lion decoupled_weight_decay scale_by_learning_rate");
  EXPECT_EQ(names(rmsprop({{"momentum", 0.9}})), "scale_by_rms trace scale_by_learning_rate");
  EXPECT_EQ(names(adagrad()), "scale_by_adagrad scale_by_learning_rate");
  // torch's defaults, read back through the hyperparameters of a plan.
  Optimizer a(adamw(), Backend::reference);
  EXPECT_EQ(a.hyper(0, "lr"), 1e-3);
  EXPECT_EQ(a.hyper(0, "b1"), 0.9);
  EXPECT_EQ(a.hyper(0, "b2"), 0.999);
  EXPECT_EQ(a.hyper(0, "eps"), 1e-8);
  EXPECT_EQ(a.hyper(0, "weight_decay"), 1e-2);
  Optimizer l(lion(), Backend::reference);
  EXPECT_EQ(l.hyper(0, "lr"), 1e-4);
  EXPECT_EQ(l.hyper(0, "b2"), 0.99);
  Optimizer r(rmsprop(), Backend::reference);
  EXPECT_EQ(r.hyper(0, "lr"), 1e-2);
  EXPECT_EQ(r.hyper(0, "alpha"), 0.99);
  Optimizer g(adagrad(), Backend::reference);
  EXPECT_EQ(g.hyper(0, "eps"), 1e-10);
}

}  // namespace
}  // namespace optfuse::rulecheck
