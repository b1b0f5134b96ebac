// RAdam, Adamax, Adadelta, Rprop and ASGD (the rules scale_by_radam, scale_by_adamax,
// scale_by_adadelta, scale_by_rprop, averaged_sgd and the named optimizers built from them) against
// the algorithms as torch.optim documents them, written out below in plain double arithmetic (where
// docs and implementation differ, the implementation, as noted), on the reference evaluator and the
// CPU backend, every storage type, two groups with different hyperparameters (group 1 often resumes
// at a later step). rule_check.h explains the per-step check and its tolerance.
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "ir/rule_check.h"

namespace optfuse::rulecheck {
namespace {

using G2 = std::array<double, 2>;

// torch.optim.RAdam: g <- -g if maximize; L2 (g += wd p) or decoupled (p *= 1 - lr wd) decay;
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; m_hat = m / (1 - b1^t);
// rho_inf = 2/(1-b2) - 1; rho_t = rho_inf - 2 t b2^t / (1 - b2^t);
// rho_t > 5: p -= lr m_hat sqrt(1-b2^t)/(sqrt(v)+eps) sqrt((rho_t-4)(rho_t-2)rho_inf/((rho_inf-4)(rho_inf-2)rho_t))
// else:      p -= lr m_hat.
RuleCase radam_case(const std::string& spec, G2 lr, G2 wd, double b1, double b2, double eps, bool decoupled,
                    bool maximize, int resume1) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_radam.exp_avg", "scale_by_radam.exp_avg_sq"};
  c.steps = 8;
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    if (wd[0] != 0) o.set_hyper(1, "weight_decay", wd[1]);
    o.set_step_count(1, resume1);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    double t = x.t;
    if (maximize) g = -g;
    if (decoupled) {
      p *= 1 - lr[k] * wd[k];
    } else {
      g += wd[k] * p;
    }
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = b2 * s[1] + (1 - b2) * g * g;
    double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    double m_hat = s[0] / bc1;
    double rho_inf = 2 / (1 - b2) - 1;
    double rho_t = rho_inf - 2 * t * std::pow(b2, t) / bc2;
    if (rho_t > 5) {
      double l = std::sqrt(bc2) / (std::sqrt(s[1]) + eps);
      double r = std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t));
      p -= lr[k] * m_hat * l * r;
    } else {
      p -= lr[k] * m_hat;
    }
    return 0.0;
  };
  return c;
}

// b2 = 0.9: rho_t passes 5 at step 6, so both branches run in group 0; group 1 resumes at step 10.
TEST(MoreOptimizers, RadamBothBranches) {
  run_everywhere(radam_case("radam(lr=0.01, betas=(0.8, 0.9), eps=1e-3)", {0.01, 0.02}, {0, 0}, 0.8, 0.9, 1e-3,
                            false, false, 10));
}
TEST(MoreOptimizers, RadamWeightDecayMaximize) {
  run_everywhere(radam_case("radam(lr=0.01, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1, maximize=true)",
                            {0.01, 0.02}, {0.1, 0.3}, 0.8, 0.9, 1e-3, false, true, 3));
}
TEST(MoreOptimizers, RadamDecoupledWeightDecay) {
  run_everywhere(radam_case("radam(lr=0.01, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.1, decoupled_weight_decay=true)",
                            {0.01, 0.02}, {0.1, 0.3}, 0.8, 0.9, 1e-3, true, false, 10));
}
// torch's defaults (b2 = 0.999): the SMA stays below 5 for the first steps (update = lr m_hat).
TEST(MoreOptimizers, RadamDefaults) {
  run_everywhere(radam_case("radam()", {1e-3, 2e-3}, {0, 0}, 0.9, 0.999, 1e-8, false, false, 0));
}

// torch.optim.Adamax: g <- -g if maximize; g += wd p; m = b1 m + (1-b1) g;
// u = max(b2 u, |g| + eps); p -= lr / (1 - b1^t) * m / u.
RuleCase adamax_case(const std::string& spec, G2 lr, G2 wd, double b1, double b2, double eps, bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_adamax.exp_avg", "scale_by_adamax.exp_inf"};
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    if (wd[0] != 0) o.set_hyper(1, "weight_decay", wd[1]);
    o.set_step_count(1, 7);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    g += wd[k] * p;
    s[0] = b1 * s[0] + (1 - b1) * g;
    s[1] = std::max(b2 * s[1], std::fabs(g) + eps);
    p -= lr[k] / (1 - std::pow(b1, x.t)) * s[0] / s[1];
    return 0.0;
  };
  return c;
}

TEST(MoreOptimizers, AdamaxDefaults) {
  run_everywhere(adamax_case("adamax()", {2e-3, 1e-2}, {0, 0}, 0.9, 0.999, 1e-8, false));
}
TEST(MoreOptimizers, AdamaxWeightDecayMaximize) {
  run_everywhere(adamax_case("adamax(lr=0.01, betas=(0.8, 0.5), eps=1e-3, weight_decay=0.1, maximize=true)",
                             {0.01, 0.02}, {0.1, 0.0}, 0.8, 0.5, 1e-3, true));
}

// torch.optim.Adadelta: g <- -g if maximize; g += wd p; v = rho v + (1-rho) g^2;
// delta = sqrt(u + eps) / sqrt(v + eps) * g; u = rho u + (1-rho) delta^2; p -= lr delta.
RuleCase adadelta_case(const std::string& spec, G2 lr, G2 wd, double rho, double eps, bool maximize) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_adadelta.square_avg", "scale_by_adadelta.acc_delta"};
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    if (wd[0] != 0) o.set_hyper(1, "weight_decay", wd[1]);
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    g += wd[k] * p;
    s[0] = rho * s[0] + (1 - rho) * g * g;
    double delta = std::sqrt(s[1] + eps) / std::sqrt(s[0] + eps) * g;
    s[1] = rho * s[1] + (1 - rho) * delta * delta;
    p -= lr[k] * delta;
    return 0.0;
  };
  return c;
}

TEST(MoreOptimizers, AdadeltaDefaults) {
  run_everywhere(adadelta_case("adadelta()", {1.0, 0.5}, {0, 0}, 0.9, 1e-6, false));
}
TEST(MoreOptimizers, AdadeltaWeightDecayMaximize) {
  run_everywhere(adadelta_case("adadelta(lr=0.5, rho=0.5, eps=1e-3, weight_decay=0.2, maximize=true)", {0.5, 0.25},
                               {0.2, 0.05}, 0.5, 1e-3, true));
}
// rho = 1 is allowed (torch: 0 <= rho <= 1): the averages never move.
TEST(MoreOptimizers, AdadeltaRhoOne) {
  run_everywhere(adadelta_case("adadelta(rho=1.0)", {1.0, 2.0}, {0, 0}, 1.0, 1e-6, false));
}

// torch.optim.Rprop: g <- -g if maximize; s = sign(g prev); the step size (lr on the first step)
// is multiplied by etaplus (s > 0), etaminus (s < 0) or 1 (s = 0) and clamped to
// [step_size_min, step_size_max]; where s < 0, g <- 0; p -= sign(g) step_size; prev = g.
RuleCase rprop_case(const std::string& spec, G2 lr, double etaminus, double etaplus, double lo, double hi,
                    bool maximize, int steps) {
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"scale_by_rprop.prev", "scale_by_rprop.step_size"};
  c.steps = steps;
  c.configure = [=](Optimizer& o) { o.set_hyper(1, "lr", lr[1]); };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    if (maximize) g = -g;
    double sg = sgn(g * s[0]);
    double factor = sg > 0 ? etaplus : (sg < 0 ? etaminus : 1.0);
    double step = (x.t == 1 ? lr[k] : s[1]) * factor;
    s[1] = std::min(std::max(step, lo), hi);
    if (sg < 0) g = 0;
    p -= sgn(g) * s[1];
    s[0] = g;
    return 0.0;
  };
  return c;
}

TEST(MoreOptimizers, RpropDefaults) {
  run_everywhere(rprop_case("rprop()", {1e-2, 3e-2}, 0.5, 1.2, 1e-6, 50, false, 6));
}
// Tight step-size bounds so that both clamps bite within a few steps.
TEST(MoreOptimizers, RpropClampedMaximize) {
  run_everywhere(rprop_case("rprop(lr=0.01, etas=(0.3, 1.9), step_sizes=(0.004, 0.02), maximize=true)", {0.01, 0.015},
                            0.3, 1.9, 0.004, 0.02, true, 8));
}

// torch.optim.ASGD (its for-loop implementation): g <- -g if maximize; g += wd p;
// eta = lr on the first step, then lr / (1 + lambd lr (t-1))^alpha; mu = 1 on the first step, then
// 1 / max(1, t - 1 - t0); p <- p (1 - lambd eta) - eta g; ax <- p if mu == 1, else ax + (p - ax) mu.
// Group 1 resumes at step resume1 with the uniform states eta and mu set to seed1 (what a state dict
// saved at that step holds: by default torch's values with this lr, else e.g. an eta computed with
// another lr, before a scheduler changed it), which its first step uses.
RuleCase asgd_case(const std::string& spec, G2 lr, G2 wd, double lambd, double alpha, double t0, bool maximize,
                   int resume1 = 0, G2 seed1 = {-1, -1}) {
  auto eta_after = [=](double l, double t) { return l / std::pow(1 + lambd * l * t, alpha); };
  auto mu_after = [=](double t) { return 1.0 / std::max(1.0, t - t0); };
  if (resume1 > 0 && seed1[0] < 0)
    seed1 = {static_cast<float>(eta_after(lr[1], resume1)), static_cast<float>(mu_after(resume1))};
  RuleCase c;
  c.name = spec;
  c.chain = parse_chain(spec);
  c.states = {"averaged_sgd.ax"};
  c.steps = 7;
  c.configure = [=](Optimizer& o) {
    o.set_hyper(1, "lr", lr[1]);
    if (wd[0] != 0) o.set_hyper(1, "weight_decay", wd[1]);
    o.set_step_count(1, resume1);
    if (resume1 > 0) {
      o.set_uniform_state(1, "eta", seed1[0]);
      o.set_uniform_state(1, "mu", seed1[1]);
    }
  };
  c.math = [=](const StepCtx& x, double g, double& p, double* s) {
    int k = x.group;
    double t = x.t;
    if (maximize) g = -g;
    g += wd[k] * p;
    bool seeded = k == 1 && resume1 > 0 && x.t == resume1 + 1;
    double eta = x.t == 1 ? lr[k] : seeded ? seed1[0] : eta_after(lr[k], t - 1);
    double mu = x.t == 1 ? 1.0 : seeded ? seed1[1] : mu_after(t - 1);
    p = p * (1 - lambd * eta) - eta * g;
    s[0] = mu == 1.0 ? p : s[0] + (p - s[0]) * mu;
    return 0.0;
  };
  return c;
}

TEST(MoreOptimizers, AsgdDefaults) {
  run_everywhere(asgd_case("asgd()", {1e-2, 3e-2}, {0, 0}, 1e-4, 0.75, 1e6, false));
}
// Large lambd (eta shrinks visibly), t0 = 1.5 (averaging starts at step 4 in group 0; group 1
// resumes at step 10), weight decay and maximize.
TEST(MoreOptimizers, AsgdAveragingWeightDecayMaximize) {
  run_everywhere(asgd_case("asgd(lr=0.05, lambd=0.5, alpha=0.6, t0=1.5, weight_decay=0.1, maximize=true)",
                           {0.05, 0.1}, {0.1, 0.2}, 0.5, 0.6, 1.5, true, 10));
}
// Group 1 resumes with eta and mu that are not this lr's (computed with an lr a scheduler has changed
// since, mu from before averaging started): its next step uses them, the steps after it this lr's.
TEST(MoreOptimizers, AsgdResumesFromItsUniformStates) {
  run_everywhere(asgd_case("asgd(lr=0.05, lambd=0.5, t0=2)", {0.05, 0.1}, {0, 0}, 0.5, 0.75, 2, false, 4, {0.2, 1.0}));
}

// The named optimizers are these chains of rules, with torch's defaults.
TEST(MoreOptimizers, ChainsAreTheDocumentedRules) {
  auto names = [](const Chain& c) {
    std::string s;
    for (const Rule& r : c) s += (s.empty() ? "" : " ") + r.name();
    return s;
  };
  EXPECT_EQ(names(radam()), "scale_by_radam scale_by_learning_rate");
  EXPECT_EQ(names(radam({{"weight_decay", 0.1}, {"maximize", true}})),
            "scale add_decayed_weights scale_by_radam scale_by_learning_rate");
  EXPECT_EQ(names(radam({{"weight_decay", 0.1}, {"decoupled_weight_decay", true}})),
            "scale_by_radam decoupled_weight_decay scale_by_learning_rate");
  EXPECT_EQ(names(adamax({{"weight_decay", 0.1}})), "add_decayed_weights scale_by_adamax scale_by_learning_rate");
  EXPECT_EQ(names(adadelta({{"maximize", true}})), "scale scale_by_adadelta scale_by_learning_rate");
  EXPECT_EQ(names(rprop()), "scale_by_rprop scale");
  EXPECT_EQ(names(rprop({{"maximize", true}})), "scale scale_by_rprop scale");
  EXPECT_EQ(names(asgd({{"weight_decay", 0.1}})), "add_decayed_weights averaged_sgd");
  Optimizer r(radam(), Backend::reference);
  EXPECT_EQ(r.hyper(0, "lr"), 1e-3);
  EXPECT_EQ(r.hyper(0, "b2"), 0.999);
  Optimizer m(adamax(), Backend::reference);
  EXPECT_EQ(m.hyper(0, "lr"), 2e-3);
  Optimizer d(adadelta(), Backend::reference);
  EXPECT_EQ(d.hyper(0, "lr"), 1.0);
  EXPECT_EQ(d.hyper(0, "rho"), 0.9);
  EXPECT_EQ(d.hyper(0, "eps"), 1e-6);
  Optimizer p(rprop(), Backend::reference);
  EXPECT_EQ(p.hyper(0, "etaminus"), 0.5);
  EXPECT_EQ(p.hyper(0, "etaplus"), 1.2);
  EXPECT_EQ(p.hyper(0, "step_size_min"), 1e-6);
  EXPECT_EQ(p.hyper(0, "step_size_max"), 50.0);
  EXPECT_EQ(p.hyper(0, "scale.factor"), -1.0);
  Optimizer a(asgd(), Backend::reference);
  EXPECT_EQ(a.hyper(0, "lr"), 1e-2);
  EXPECT_EQ(a.hyper(0, "lambd"), 1e-4);
  EXPECT_EQ(a.hyper(0, "alpha"), 0.75);
  EXPECT_EQ(a.hyper(0, "t0"), 1e6);
  EXPECT_EQ(a.uniform_state(0, "eta"), 1e-2);  // torch's initial eta (lr) and mu
  EXPECT_EQ(a.uniform_state(0, "averaged_sgd.mu"), 1.0);
  EXPECT_THROW(a.hyper(0, "eta_lr"), Error);
}

// torch's argument checks, as the named optimizers' errors.
TEST(MoreOptimizers, InvalidArgumentsAreRefused) {
  auto message = [](const std::string& spec) {
    try {
      parse_chain(spec);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message("rprop(etas=(1.5, 1.2))").find("etaminus=1.5 is invalid: must be in (0, 1)"), std::string::npos)
      << message("rprop(etas=(1.5, 1.2))");
  EXPECT_NE(message("rprop(etas=(0.5, 0.9))").find("etaplus=0.9 is invalid: must be > 1"), std::string::npos)
      << message("rprop(etas=(0.5, 0.9))");
  EXPECT_NE(message("adadelta(rho=1.5)").find("rho=1.5 is invalid: must be in [0, 1]"), std::string::npos)
      << message("adadelta(rho=1.5)");
  EXPECT_NE(message("radam(betas=(0.9, 1.0))").find("b2=1 is invalid"), std::string::npos)
      << message("radam(betas=(0.9, 1.0))");
  EXPECT_NE(message("asgd(lambd=-1)").find("lambd=-1 is invalid: must be >= 0"), std::string::npos)
      << message("asgd(lambd=-1)");
  EXPECT_NE(message("adamax(eps=-1)").find("eps=-1 is invalid"), std::string::npos) << message("adamax(eps=-1)");
}

}  // namespace
}  // namespace optfuse::rulecheck
