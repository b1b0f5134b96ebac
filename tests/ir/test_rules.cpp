// Every built-in rule against its published formula, written out below in plain double arithmetic
// (optax's rule definitions, torch.optim's documented algorithms, the Lion paper), on the reference
// evaluator and the CPU backend, float32 / bfloat16 / float16 storage, two parameter groups with
// different hyperparameters, 5 steps with new gradients each step. rule_check.h explains how
// each step is checked and the tolerance.
//
// A rule on its own is a chain too (param += update), which is how most cases below run it, so
// that what is checked is the rule's own update and not what a later rule does with it.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <array>

#include "ir/rule_check.h"

namespace optfuse::rulecheck {
namespace {

// Per-group hyperparameters in the model: index by StepCtx::group.
using G2 = std::array<double, 2>;

// optax.scale_by_adam: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2,
// update = m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1-b1^t), v_hat = v / (1-b2^t);
// with amsgrad (torch's implementation) the running max of the uncorrected v replaces v.
RuleCase adam_rule_case(bool amsgrad) {
  RuleCase c;
  G2 b1{0.8, 0.7}, b2{0.95, 0.9}, eps{1e-3, 1e-6};
  c.name = amsgrad ? "scale_by_adam(amsgrad)" : "scale_by_adam";
  if (amsgrad) {
    c.chain = parse_chain("scale_by_adam(b1=0.8, b2=0.95, eps=1e-3, amsgrad=true)");
    c.states = {"scale_by_adam.exp_avg", "scale_by_adam.exp_avg_sq", "scale_by_adam.max_exp_avg_sq"};
  } else {
    c.chain = make_builtin("scale_by_adam", {{"b1", 0.8}, {"b2", 0.95}, {"eps", 1e-3}});
    c.states = {"scale_by_adam.exp_avg", "scale_by_adam.exp_avg_sq"};
  }
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "b1", b1[1]);
    o.set_hyper(1, "scale_by_adam.b2", b2[1]);  // qualified names work too
    o.set_hyper(1, "eps", eps[1]);
    // Group 1 resumes at step 10: bias corrections must use each group's own step.
    o.set_step_count(1, 10);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    s[0] = b1[k] * s[0] + (1 - b1[k]) * g;
    s[1] = b2[k] * s[1] + (1 - b2[k]) * g * g;
    double v = s[1];
    if (amsgrad) v = s[2] = std::max(s[2], s[1]);
    double m_hat = s[0] / (1 - std::pow(b1[k], x.t)), v_hat = v / (1 - std::pow(b2[k], x.t));
    p += m_hat / (std::sqrt(v_hat) + eps[k]);
    return 0.0;
  };
  return c;
}

TEST(Rules, ScaleByAdam) { run_everywhere(adam_rule_case(false)); }
TEST(Rules, ScaleByAdamAmsgrad) { run_everywhere(adam_rule_case(true)); }

// optax.add_decayed_weights: update = g + weight_decay * param.
TEST(Rules, AddDecayedWeights) {
  RuleCase c;
  G2 wd{0.1, 0.3};
  c.name = "add_decayed_weights";
  c.chain = make_builtin("add_decayed_weights", {{"weight_decay", wd[0]}});
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "weight_decay", wd[1]); };
  c.math = [=](const StepCtx& x, double g, double& p, double*) {
    p += g + wd[x.group] * p;
    return 0.0;
  };
  run_everywhere(c);
}

// torch.optim.AdamW's decay: param *= 1 - lr * weight_decay, then the update is added.
TEST(Rules, DecoupledWeightDecay) {
  RuleCase c;
  G2 lr{0.1, 0.2}, wd{0.1, 0.3};
  c.name = "decoupled_weight_decay";
  c.chain = make_builtin("decoupled_weight_decay", {{"lr", lr[0]}, {"weight_decay", wd[0]}});
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    o.set_hyper(1, "weight_decay", wd[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double*) {
    p = p * (1.0 - lr[x.group] * wd[x.group]) + g;
    return 0.0;
  };
  run_everywhere(c);
}

// optax.scale_by_learning_rate: update = -lr * g.
TEST(Rules, ScaleByLearningRate) {
  RuleCase c;
  G2 lr{0.1, 0.25};
  c.name = "scale_by_learning_rate";
  c.chain = parse_chain("scale_by_learning_rate(0.1)");
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "lr", lr[1]); };
  c.math = [=](const StepCtx& x, double g, double& p, double*) {
    p -= lr[x.group] * g;
    return 0.0;
  };
  run_everywhere(c);
}

// optax.scale: update = factor * g (a negative factor included).
TEST(Rules, Scale) {
  RuleCase c;
  G2 f{-0.5, 2.0};
  c.name = "scale";
  c.chain = parse_chain("scale(-0.5)");
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "factor", f[1]); };
  c.math = [=](const StepCtx& x, double g, double& p, double*) {
    p += f[x.group] * g;
    return 0.0;
  };
  run_everywhere(c);
}

// torch.optim.SGD's momentum buffer: b = g on the first step, then b = momentum b + (1-dampening) g;
// the update is g + momentum b with nesterov, else b.
RuleCase trace_case(G2 mom, G2 damp, bool nesterov) {
  RuleCase c;
  c.name = std::string("trace(") + (nesterov ? "nesterov" : "heavy ball") + (damp[0] != 0 ? ", dampening)" : ")");
  Args a{{"momentum", mom[0]}, {"nesterov", nesterov}};
  if (damp[0] != 0) a["dampening"] = damp[0];  // default dampening is 0
  c.chain = make_builtin("trace", a);
  c.states = {"trace.momentum_buffer"};
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "momentum", mom[1]);
    o.set_hyper(1, "dampening", damp[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    s[0] = x.t == 1 ? g : mom[k] * s[0] + (1 - damp[k]) * g;
    p += nesterov ? g + mom[k] * s[0] : s[0];
    return 0.0;
  };
  return c;
}

TEST(Rules, TraceDefault) {
  RuleCase c = trace_case({0.9, 0.5}, {0.0, 0.0}, false);
  c.chain = parse_chain("trace()");  // defaults: momentum 0.9, dampening 0, nesterov false
  run_everywhere(c);
}
TEST(Rules, TraceDampening) { run_everywhere(trace_case({0.8, 0.6}, {0.25, 0.5}, false)); }
TEST(Rules, TraceNesterov) { run_everywhere(trace_case({0.8, 0.6}, {0.0, 0.0}, true)); }
TEST(Rules, TraceNesterovDampening) { run_everywhere(trace_case({0.7, 0.9}, {0.3, 0.1}, true)); }

// Lion (Chen et al. 2023, Algorithm 2 without lr and weight decay):
// update = sign(b1 m + (1-b1) g); then m = b2 m + (1-b2) g.
TEST(Rules, ScaleByLion) {
  RuleCase c;
  G2 b1{0.9, 0.5}, b2{0.99, 0.8};
  c.name = "scale_by_lion";
  c.chain = parse_chain("scale_by_lion()");  // defaults b1=0.9, b2=0.99
  c.states = {"scale_by_lion.exp_avg"};
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "b1", b1[1]);
    o.set_hyper(1, "b2", b2[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    double a = b1[k] * s[0], b = (1 - b1[k]) * g, dir = a + b;
    p += sgn(dir);
    s[0] = b2[k] * s[0] + (1 - b2[k]) * g;
    // Within float32 rounding of zero the sign is not determined by the formula.
    return std::fabs(dir) <= 1e-5 * (std::fabs(a) + std::fabs(b)) ? 2.0 : 0.0;
  };
  run_everywhere(c);
}

// torch.optim.RMSprop's scaling: sq = alpha sq + (1-alpha) g^2; centered: ga = alpha ga + (1-alpha) g
// and the denominator is sqrt(sq - ga^2) + eps, else sqrt(sq) + eps (eps outside the root, as torch).
RuleCase rms_case(bool centered) {
  RuleCase c;
  G2 alpha{0.9, 0.8}, eps{1e-3, 1e-2};
  c.name = centered ? "scale_by_rms(centered)" : "scale_by_rms";
  c.chain = make_builtin("scale_by_rms", {{"alpha", 0.9}, {"eps", 1e-3}, {"centered", centered}});
  c.states = {"scale_by_rms.square_avg"};
  if (centered) c.states.push_back("scale_by_rms.grad_avg");
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "alpha", alpha[1]);
    o.set_hyper(1, "eps", eps[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    s[0] = alpha[k] * s[0] + (1 - alpha[k]) * g * g;
    double var = s[0];
    if (centered) {
      s[1] = alpha[k] * s[1] + (1 - alpha[k]) * g;
      var -= s[1] * s[1];
    }
    p += g / (std::sqrt(var) + eps[k]);
    return 0.0;
  };
  return c;
}

TEST(Rules, ScaleByRms) { run_everywhere(rms_case(false)); }
TEST(Rules, ScaleByRmsCentered) { run_everywhere(rms_case(true)); }

// torch.optim.Adagrad's scaling: sum starts at initial_accumulator_value, sum += g^2,
// update = g / (sqrt(sum) + eps) / (1 + (t-1) lr_decay).
TEST(Rules, ScaleByAdagrad) {
  RuleCase c;
  G2 eps{1e-10, 1e-3}, decay{0.5, 0.25};
  c.name = "scale_by_adagrad";
  c.chain = parse_chain("scale_by_adagrad(lr_decay=0.5, initial_accumulator_value=0.1)");
  c.states = {"scale_by_adagrad.sum"};
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "eps", eps[1]);
    o.set_hyper(1, "lr_decay", decay[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    s[0] += g * g;
    p += g / (std::sqrt(s[0]) + eps[k]) / (1 + (x.t - 1) * decay[k]);
    return 0.0;
  };
  run_everywhere(c);
}

// The accumulator's initial value reaches the state buffers through Program::states.
TEST(Rules, AdagradInitialAccumulatorIsTheStateInit) {
  Plan plan = make_plan(parse_chain("scale_by_adagrad(initial_accumulator_value=0.25)"));
  ASSERT_EQ(plan.program.states.size(), 1u);
  EXPECT_EQ(plan.program.states[0].init, 0.25);
}

// torch.nn.utils.clip_grad_norm_: norm over every gradient of the step, coef = max_norm/(norm+1e-6)
// clamped to 1. Group 0 clips hard (norm is about 258 over 66569 elements); group 1's max_norm is
// so large that it does not clip: the norm is global, the coefficient per group.
TEST(Rules, ClipByGlobalNorm) {
  RuleCase c;
  G2 max_norm{50, 1e6}, lr{0.1, 0.2};
  c.name = "clip_by_global_norm";
  c.chain = chain({clip_by_global_norm(50), make_builtin("scale_by_learning_rate", {{"lr", 0.1}})});
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "max_norm", max_norm[1]);
    o.set_hyper(1, "lr", lr[1]);
  };
  c.global = [=](const Grads& g) {
    double inv_norm = clip_coefficient(g, 1.0);  // 1/(norm + 1e-6)
    EXPECT_LT(max_norm[0] * inv_norm, 0.5);      // group 0 really clips
    return inv_norm;
  };
  c.math = [=](const StepCtx& x, double g, double& p, double*) {
    double coef = std::min(max_norm[x.group] * x.global, 1.0);
    p -= lr[x.group] * g * coef;
    return 0.0;
  };
  run_everywhere(c);
}

// torch.amp.GradScaler's contract: gradients arrive multiplied by grad_scale and are divided by it;
// found_inf skips the whole step (param, state and step count). Clipping sees unscaled gradients,
// and Adam's bias correction after the skipped step uses the step count without it.
TEST(Rules, UnscaleByGradScaleWithFoundInf) {
  RuleCase c;
  const double scale = 1024, b1 = 0.9, b2 = 0.999, eps = 1e-8;  // scale_by_adam defaults
  G2 lr{0.1, 0.05};
  c.name = "unscale_by_grad_scale";
  c.chain = parse_chain("chain(unscale_by_grad_scale(), clip_by_global_norm(100.0), scale_by_adam(), "
                        "scale_by_learning_rate(0.1))");
  c.states = {"scale_by_adam.exp_avg", "scale_by_adam.exp_avg_sq"};
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "lr", lr[1]); };
  c.grad_scale = static_cast<float>(scale);
  c.found_inf_step = 3;
  c.global = [=](const Grads& g) { return clip_coefficient(g, 100.0, scale); };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    g = g / scale * x.global;
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = b2 * s[1] + (1 - b2) * g * g;
    double m_hat = s[0] / (1 - std::pow(b1, x.t)), v_hat = s[1] / (1 - std::pow(b2, x.t));
    p -= lr[x.group] * m_hat / (std::sqrt(v_hat) + eps);
    return 0.0;
  };
  run_everywhere(c);
}

// A NaN in one gradient element skips the step for every tensor of every group.
TEST(Rules, SkipIfNonfinite) {
  RuleCase c;
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  G2 lr{0.1, 0.03};
  c.name = "skip_if_nonfinite";
  c.chain = chain({make_builtin("skip_if_nonfinite"), adam({{"lr", 0.1}})});
  c.states = {"scale_by_adam.exp_avg", "scale_by_adam.exp_avg_sq"};
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "lr", lr[1]); };
  c.nonfinite_step = 2;
  c.skips_nonfinite = true;
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = b2 * s[1] + (1 - b2) * g * g;
    double m_hat = s[0] / (1 - std::pow(b1, x.t)), v_hat = s[1] / (1 - std::pow(b2, x.t));
    p -= lr[x.group] * m_hat / (std::sqrt(v_hat) + eps);
    return 0.0;
  };
  run_everywhere(c);
}

// The harness itself must be able to fail: a formula with a wrong bias correction is caught.
TEST(Rules, HarnessCatchesAWrongFormula) {
  RuleCase c = adam_rule_case(false);
  ElementMath right = c.math;
  c.math = [right](const StepCtx& x, double g, double& p, double* s) {
    StepCtx off = x;
    off.t = x.t + 1;  // off by one step
    return right(off, g, p, s);
  };
  c.steps = 2;
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter catcher(&failures);
    run_case(c, Backend::reference, DType::f32);
  }
  ASSERT_GT(failures.size(), 0);
  EXPECT_NE(std::string(failures.GetTestPartResult(0).message()).find("param"), std::string::npos);
}

}  // namespace
}  // namespace optfuse::rulecheck
