// The math of every built-in rule. Each follows torch's for-loop implementation's order of
// operations where it matters for float32 rounding (lerp for exp_avg, addcmul as (v*b2) +
// ((1-b2)*g)*g, bias corrections in float64 as uniform values), so that the drop-in optimizers
// match torch to rounding. `u` is the incoming update: the gradient for the first rule of a chain.
#include "rules/builtin_rules.h"

#include <cmath>

#include "optfuse/error.h"
#include "rules/moments.h"

namespace optfuse::rules {

static const Range kBeta = Range::unit_interval_open_right();

Rule scale_by_adam(double b1, double b2, double eps, bool amsgrad) {
  Rule r("scale_by_adam");
  r.hyper("b1", b1, kBeta).hyper("b2", b2, kBeta).hyper("eps", eps, Range::non_negative());
  r.state("exp_avg").state("exp_avg_sq");
  if (amsgrad) r.state("max_exp_avg_sq").note("amsgrad=true");
  return r.update([amsgrad](RuleBuilder& b) {
    Expr u = b.update(), t = b.step();
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2");
    Expr m = new_exp_avg(b, u, b1);
    Expr v = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg", m);
    b.set_state("exp_avg_sq", v);
    if (amsgrad) {
      v = max(b.state("max_exp_avg_sq"), v);
      b.set_state("max_exp_avg_sq", v);
    }
    Expr inv_bc1 = b.name(1.0 / (1.0 - pow(b1, t)), "inv_bias_correction1");
    Expr bc2_sqrt = b.name(sqrt(1.0 - pow(b2, t)), "bias_correction2_sqrt");
    Expr denom = b.name(sqrt(v) / bc2_sqrt + b.hyper("eps"), "denom");
    return (m * inv_bc1) / denom;
  });
}

Rule add_decayed_weights(double weight_decay) {
  Rule r("add_decayed_weights");
  r.hyper("weight_decay", weight_decay, Range::non_negative());
  return r.update([](RuleBuilder& b) { return b.update() + b.hyper("weight_decay") * b.param(); });
}

// AdamW's and Lion's decay as torch and lion-pytorch write it: p *= 1 - lr * wd before the update
// is added (the same math as add_decayed_weights before scale_by_learning_rate, rounded as torch
// rounds it). Its lr is set together with scale_by_learning_rate's: both are named "lr".
Rule decoupled_weight_decay(double lr, double weight_decay) {
  Rule r("decoupled_weight_decay");
  r.hyper("lr", lr, Range::non_negative()).hyper("weight_decay", weight_decay, Range::non_negative());
  return r.update([](RuleBuilder& b) {
    b.scale_param(b.name(1.0 - b.hyper("lr") * b.hyper("weight_decay"), "decay_factor"));
    return b.update();
  });
}

Rule scale_by_learning_rate(double lr) {
  Rule r("scale_by_learning_rate");
  r.hyper("lr", lr, Range::non_negative());
  return r.update([](RuleBuilder& b) { return b.update() * -b.hyper("lr"); });
}

Rule scale(double factor) {
  Rule r("scale");
  r.hyper("factor", factor);
  return r.update([](RuleBuilder& b) { return b.update() * b.hyper("factor"); });
}

// Heavy-ball momentum as torch.optim.SGD: the buffer starts as the first update (no dampening on
// the first step), then buf = momentum*buf + (1-dampening)*u.
Rule trace(double momentum, double dampening, bool nesterov) {
  Rule r("trace");
  r.hyper("momentum", momentum, Range::non_negative()).hyper("dampening", dampening);
  r.state("momentum_buffer");
  if (nesterov) r.note("nesterov=true");
  return r.update([nesterov](RuleBuilder& b) {
    Expr u = b.update(), mom = b.hyper("momentum");
    Expr later = b.state("momentum_buffer") * mom + (1.0 - b.hyper("dampening")) * u;
    Expr buf = select(b.step() == 1.0, u, later);
    b.set_state("momentum_buffer", buf);
    return nesterov ? u + mom * buf : buf;
  });
}

// Lion (Chen et al. 2023), as lion-pytorch: sign of an interpolation of momentum and update; the
// momentum itself moves with b2.
Rule scale_by_lion(double b1, double b2) {
  Rule r("scale_by_lion");
  r.hyper("b1", b1, kBeta).hyper("b2", b2, kBeta);
  r.state("exp_avg");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), m = b.state("exp_avg");
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2");
    Expr dir = b.name(sign(m * b1 + (1.0 - b1) * u), "lion_direction");
    b.set_state("exp_avg", m * b2 + (1.0 - b2) * u);
    return dir;
  });
}

// RMSprop as torch: eps is added after the square root (optax adds it inside).
Rule scale_by_rms(double alpha, double eps, bool centered) {
  Rule r("scale_by_rms");
  r.hyper("alpha", alpha, kBeta).hyper("eps", eps, Range::non_negative());
  r.state("square_avg");
  if (centered) r.state("grad_avg").note("centered=true");
  return r.update([centered](RuleBuilder& b) {
    Expr u = b.update(), alpha = b.hyper("alpha");
    Expr sq = b.state("square_avg") * alpha + (1.0 - alpha) * u * u;
    b.set_state("square_avg", sq);
    Expr var = sq;
    if (centered) {
      Expr ga = lerp(b.state("grad_avg"), u, 1.0 - alpha);
      b.set_state("grad_avg", ga);
      var = sq + (-1.0 * ga) * ga;
    }
    Expr avg = b.name(sqrt(var) + b.hyper("eps"), "rms");
    return u / avg;
  });
}

Rule scale_by_adagrad(double eps, double initial_accumulator_value, double lr_decay) {
  Rule r("scale_by_adagrad");
  r.hyper("eps", eps, Range::non_negative()).hyper("lr_decay", lr_decay, Range::non_negative());
  if (!(initial_accumulator_value >= 0))
    throw Error("scale_by_adagrad: initial_accumulator_value must be >= 0");
  r.state("sum", initial_accumulator_value);
  return r.update([](RuleBuilder& b) {
    Expr u = b.update();
    Expr sum = b.state("sum") + u * u;
    b.set_state("sum", sum);
    Expr decay = b.name(1.0 / (1.0 + (b.step() - 1.0) * b.hyper("lr_decay")), "lr_decay_factor");
    return (u / (sqrt(sum) + b.hyper("eps"))) * decay;
  });
}

// As torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to at most 1.
Rule clip_by_global_norm(double max_norm) {
  Rule r("clip_by_global_norm");
  r.hyper("max_norm", max_norm, Range::positive());
  return r.update([](RuleBuilder& b) {
    Expr u = b.update();
    Expr norm = b.name(sqrt(global_sum_of_squares(u)), "global_norm");
    Expr coef = b.name(min(b.hyper("max_norm") / (norm + 1e-6), 1.0), "clip_coef");
    return u * coef;
  });
}

// torch.amp.GradScaler's contract: gradients arrive multiplied by grad_scale; found_inf != 0 means
// the scaler saw inf/NaN and the whole step must be skipped.
Rule unscale_by_grad_scale() {
  Rule r("unscale_by_grad_scale");
  return r.update([](RuleBuilder& b) {
    b.skip_step_if(b.global(kFoundInf) != 0.0);
    return b.update() * b.name(1.0 / b.global(kGradScale), "inv_grad_scale");
  });
}

Rule skip_if_nonfinite() {
  Rule r("skip_if_nonfinite");
  return r.update([](RuleBuilder& b) {
    b.skip_step_if(b.name(any_nonfinite(b.update()), "update_nonfinite"));
    return b.update();
  });
}

// A uniform (float64) value rounded to float32 precision, still as a float64: Veltkamp's split
// (c = x * (2^29 + 1); x rounded to 53 - 29 = 24 significant bits is c - (c - x)), exact for
// normal float32 magnitudes, ties aside. Used where torch keeps a per-step scalar in a float32
// tensor and then does float64 math with its value (ASGD's eta and mu): the uniform value must be
// rounded before that math, not only where it meets element values. Uniform values only: on an
// element value this would be float32 arithmetic and mean nothing. (No float64 contraction happens:
// scalar phases run in the interpreter, generated code is compiled without fp contraction.)
static Expr round_uniform_to_f32(Expr x) {
  Expr c = x * 536870913.0;
  return c - (c - x);
}

// RAdam (Liu et al. 2019) as torch.optim.RAdam: Adam's moments; while the length of the
// approximated SMA rho_t is <= 5 the update is the bias-corrected first moment alone, after that
// it is multiplied by the adaptive term sqrt(1 - b2^t) / (sqrt(v) + eps) and the rectification
// sqrt((rho_t-4)(rho_t-2)rho_inf / ((rho_inf-4)(rho_inf-2)rho_t)). All of rho and the
// rectification are uniform (float64, as torch computes them in Python); the branch is a select.
Rule scale_by_radam(double b1, double b2, double eps) {
  Rule r("scale_by_radam");
  r.hyper("b1", b1, kBeta).hyper("b2", b2, kBeta).hyper("eps", eps, Range::non_negative());
  r.state("exp_avg").state("exp_avg_sq");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step();
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2");
    Expr m = new_exp_avg(b, u, b1);
    Expr v = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg", m);
    b.set_state("exp_avg_sq", v);
    Expr bc1 = b.name(1.0 - pow(b1, t), "bias_correction1");
    Expr bc2 = b.name(1.0 - pow(b2, t), "bias_correction2");
    Expr m_hat = b.name(m / bc1, "bias_corrected_exp_avg");
    Expr rho_inf = b.name(2.0 / (1.0 - b2) - 1.0, "rho_inf");
    Expr rho_t = b.name(rho_inf - 2.0 * t * pow(b2, t) / bc2, "rho_t");
    // torch writes x ** 0.5 for both square roots: pow, not sqrt (they may differ in the last bit).
    Expr rect = b.name(pow((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t), 0.5),
                       "rectification");
    Expr adaptive = b.name(pow(bc2, 0.5) / (sqrt(v) + b.hyper("eps")), "adaptive_lr");
    return select(b.name(rho_t > 5.0, "rectified"), (m_hat * adaptive) * rect, m_hat);
  });
}

// Adamax (Kingma & Ba 2015, section 7.1) as torch.optim.Adamax: exp_inf = max(b2 exp_inf,
// |u| + eps) (NaN-propagating, as torch.maximum); update = exp_avg / (1 - b1^t) / exp_inf.
Rule scale_by_adamax(double b1, double b2, double eps) {
  Rule r("scale_by_adamax");
  r.hyper("b1", b1, kBeta).hyper("b2", b2, kBeta).hyper("eps", eps, Range::non_negative());
  r.state("exp_avg").state("exp_inf");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step();
    Expr b1 = b.hyper("b1");
    Expr m = new_exp_avg(b, u, b1);
    Expr e = b.name(max(b.state("exp_inf") * b.hyper("b2"), abs(u) + b.hyper("eps")), "exp_inf_new");
    b.set_state("exp_avg", m);
    b.set_state("exp_inf", e);
    Expr inv_bc1 = b.name(1.0 / (1.0 - pow(b1, t)), "inv_bias_correction1");
    return (m * inv_bc1) / e;
  });
}

// Adadelta (Zeiler 2012) as torch.optim.Adadelta (lr is applied by the next rule):
// square_avg = rho square_avg + (1-rho) u^2; delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * u;
// acc_delta = rho acc_delta + (1-rho) delta^2; update = delta.
Rule scale_by_adadelta(double rho, double eps) {
  Rule r("scale_by_adadelta");
  r.hyper("rho", rho, Range{0, 1, false, false}).hyper("eps", eps, Range::non_negative());
  r.state("square_avg").state("acc_delta");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), rho = b.hyper("rho"), eps = b.hyper("eps");
    Expr sq = b.name(b.state("square_avg") * rho + (1.0 - rho) * u * u, "square_avg_new");
    Expr std_ = b.name(sqrt(sq + eps), "std");
    Expr delta = b.name(sqrt(b.state("acc_delta") + eps) / std_ * u, "delta");
    b.set_state("square_avg", sq);
    b.set_state("acc_delta", b.state("acc_delta") * rho + (1.0 - rho) * delta * delta);
    return delta;
  });
}

// Rprop as torch.optim.Rprop (and optax.scale_by_rprop: the update is sign * step size; the
// named optimizer negates it). Per element: s = sign(u * prev); the step size is multiplied by
// etaplus (s > 0), etaminus (s < 0) or 1 (s == 0; NaN stays NaN) and clamped to
// [step_size_min, step_size_max]; where the factor is etaminus the update u is replaced by 0 (and
// so is the prev kept for the next step); update = sign(u) * step_size. torch starts step_size at
// lr: here the step size read on a group's first step is lr (later lr changes do not matter, as
// in torch).
Rule scale_by_rprop(double lr, double etaminus, double etaplus, double step_size_min, double step_size_max) {
  Rule r("scale_by_rprop");
  r.hyper("lr", lr, Range::non_negative())
      .hyper("etaminus", etaminus, Range{0, 1, true, true})
      .hyper("etaplus", etaplus, Range{1, 1e308, true, false})
      .hyper("step_size_min", step_size_min)
      .hyper("step_size_max", step_size_max);
  r.state("prev").state("step_size");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), etaminus = b.hyper("etaminus");
    Expr s = b.name(sign(u * b.state("prev")), "prev_sign");
    Expr factor = b.name(select(s > b.constant(0.0), b.hyper("etaplus"),
                                select(s < b.constant(0.0), etaminus, select(s == 0.0, b.constant(1.0), s))),
                         "step_size_factor");
    Expr old = select(b.step() == 1.0, b.hyper("lr"), b.state("step_size"));
    Expr ss = b.name(min(max(old * factor, b.hyper("step_size_min")), b.hyper("step_size_max")), "step_size_new");
    Expr kept = b.name(select(factor == etaminus, b.constant(0.0), u), "kept_update");
    b.set_state("step_size", ss);
    b.set_state("prev", kept);
    return sign(kept) * ss;
  });
}

// NAdam (Dozat 2016) as torch.optim.NAdam, the last rule of its chain (it includes lr and adds its
// two terms to the parameter one after the other, as torch's two addcdiv_ calls round them):
//   mu_t = b1 (1 - 0.5 * 0.96^(t psi)), mu_next = b1 (1 - 0.5 * 0.96^((t + 1) psi))  (psi: momentum_decay)
//   mu_product <- mu_product * mu_t          (a uniform state, one per group, float32 as torch's tensor)
//   exp_avg, exp_avg_sq as Adam's; denom = sqrt(exp_avg_sq / (1 - b2^t)) + eps
//   param += (-lr (1 - mu_t) / (1 - mu_product)) * u / denom
//   param += (-lr mu_next / (1 - mu_product * mu_next)) * exp_avg / denom
// torch keeps mu_product in a float32 0-dim tensor (mu_product *= mu: float32 times mu rounded to
// float32) and does the rest in float64 with its value: the new value is rounded to float32 here.
Rule scale_by_nadam(double lr, double b1, double b2, double eps, double momentum_decay) {
  Rule r("scale_by_nadam");
  r.hyper("lr", lr, Range::non_negative()).hyper("b1", b1, kBeta).hyper("b2", b2, kBeta);
  r.hyper("eps", eps, Range::non_negative()).hyper("momentum_decay", momentum_decay, Range::non_negative());
  r.state("exp_avg").state("exp_avg_sq");
  r.uniform_state("mu_product", 1.0);
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step(), lr = b.hyper("lr");
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2"), psi = b.hyper("momentum_decay");
    Expr m = new_exp_avg(b, u, b1);
    Expr v = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg", m);
    b.set_state("exp_avg_sq", v);
    Expr mu = b.name(b1 * (1.0 - 0.5 * pow(0.96, t * psi)), "mu");
    Expr mu_next = b.name(b1 * (1.0 - 0.5 * pow(0.96, (t + 1.0) * psi)), "mu_next");
    Expr mu_product = b.name(round_uniform_to_f32(b.uniform_state("mu_product") * round_uniform_to_f32(mu)), "mu_product_new");
    b.set_uniform_state("mu_product", mu_product);
    Expr bc2 = b.name(1.0 - pow(b2, t), "bias_correction2");
    Expr denom = b.name(sqrt(v / bc2) + b.hyper("eps"), "denom");
    Expr grad_coef = b.name(-lr * (1.0 - mu) / (1.0 - mu_product), "grad_coef");
    Expr exp_avg_coef = b.name(-lr * mu_next / (1.0 - mu_product * mu_next), "exp_avg_coef");
    b.set_param_base(b.param_base() + grad_coef * u / denom);
    return exp_avg_coef * m / denom;
  });
}

// ASGD as torch.optim.ASGD, the last rule of its chain (it reads the new parameter to update the
// average): param <- param * (1 - lambd * eta) - eta * u, then ax <- param if mu == 1 else
// ax + (param - ax) * mu. torch keeps eta and mu per parameter in float32 tensors, starts them at lr
// and 1 on a parameter's first step and, at the end of each step t, sets them from the new step
// count and the group's values of that step: eta = lr / (1 + lambd * lr * t)^alpha,
// mu = 1 / max(1, t - t0) (float64 math, stored as float32). They are uniform states here, read by
// the next step and committed only where the step is not skipped: an lr changed between steps (a
// scheduler), or lambd, alpha or t0 changed, takes effect as in torch, one step later for eta and mu.
Rule averaged_sgd(double lr, double lambd, double alpha, double t0) {
  Rule r("averaged_sgd");
  r.hyper("lr", lr, Range::non_negative())
      .hyper("lambd", lambd, Range::non_negative())
      .hyper("alpha", alpha, Range::non_negative())
      .hyper("t0", t0);
  r.state("ax");
  r.uniform_state("eta", lr).uniform_state("mu", 1.0);
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step(), lr = b.hyper("lr"), lambd = b.hyper("lambd");
    Expr first = t == 1.0;  // torch's initial values, whatever the states hold (a group restarted at step 0)
    Expr eta = b.name(select(first, round_uniform_to_f32(lr), b.uniform_state("eta")), "eta");
    Expr mu = b.name(select(first, b.constant(1.0), b.uniform_state("mu")), "mu");
    Expr decay = b.name(1.0 - lambd * eta, "decay_factor");
    b.scale_param(decay);
    Expr update = u * -eta;
    Expr param_new = b.param() * decay + update;  // the chain's new parameter (this rule is last)
    Expr ax = b.state("ax");
    b.set_state("ax", select(mu != 1.0, ax + (param_new - ax) * mu, param_new));
    Expr eta_new = lr / pow(1.0 + lambd * lr * t, b.hyper("alpha"));
    b.set_uniform_state("eta", b.name(round_uniform_to_f32(eta_new), "eta_new"));
    Expr mu_new = 1.0 / max(b.constant(1.0), t - b.hyper("t0"));
    b.set_uniform_state("mu", b.name(round_uniform_to_f32(mu_new), "mu_new"));
    return update;
  });
}

// AdEMAMix (Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older",
// Algorithm 1, and its reference implementation apple/ml-ademamix), without lr and weight decay
// (the named optimizer adds both after this rule: p -= lr * (update + wd * p), the paper's line
// 11 and the reference's order). Three EMAs of the incoming update u:
//   exp_avg_fast = b1 exp_avg_fast + (1-b1) u          (m1, bias-corrected by 1 - b1^t)
//   exp_avg_slow = b3_t exp_avg_slow + (1-b3_t) u      (m2, not bias-corrected)
//   exp_avg_sq   = b2 exp_avg_sq + (1-b2) u^2          (nu, bias-corrected by 1 - b2^t)
//   update = (exp_avg_fast / (1 - b1^t) + alpha_t exp_avg_slow) / (sqrt(exp_avg_sq) / sqrt(1 - b2^t) + eps)
// The warm-ups are uniform functions of the step, so t_alpha and t_beta3 are hyperparameters like
// any other (0 turns a warm-up off, as the reference's None: the warm-up branch needs t < T):
//   alpha_t = (t / T_alpha) alpha                       while t < T_alpha, else alpha
//   b3_t    = f^-1((1 - a) f(b1) + a f(b3)), a = t / T_beta3   while t < T_beta3, else b3
// with f(b) = ln(0.5) / ln(b + 1e-8) - 1 (the half-life of an EMA of factor b, less one) and
// f^-1(x) = 0.5^(1 / (x + 1)): the paper's beta3 scheduler, linear in half-life from b1 to b3.
// The moments are written as the reference's mul_(b).add_(u, alpha=1-b) (not lerp).
Rule scale_by_ademamix(double b1, double b2, double b3, double alpha, double t_alpha, double t_beta3, double eps) {
  Rule r("scale_by_ademamix");
  r.hyper("b1", b1, kBeta).hyper("b2", b2, kBeta).hyper("b3", b3, kBeta);
  r.hyper("alpha", alpha, Range::non_negative());
  r.hyper("t_alpha", t_alpha, Range::non_negative()).hyper("t_beta3", t_beta3, Range::non_negative());
  r.hyper("eps", eps, Range::non_negative());
  r.state("exp_avg_fast").state("exp_avg_slow").state("exp_avg_sq");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step();
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2"), b3 = b.hyper("b3");
    Expr t_alpha = b.hyper("t_alpha"), t_beta3 = b.hyper("t_beta3");
    // Warm-ups (uniform, float64). The branch not taken may be inf/NaN (T = 0): select drops it.
    Expr alpha = b.name(select(t < t_alpha, (t / t_alpha) * b.hyper("alpha"), b.hyper("alpha")), "alpha_t");
    auto half_life = [](Expr beta) { return std::log(0.5) / log(beta + 1e-8) - 1.0; };
    Expr a = t / t_beta3;
    Expr b3_warm = pow(0.5, 1.0 / (((1.0 - a) * half_life(b1) + a * half_life(b3)) + 1.0));
    Expr b3_t = b.name(select(t < t_beta3, b3_warm, b3), "beta3_t");
    Expr m1 = b.name(b.state("exp_avg_fast") * b1 + (1.0 - b1) * u, "exp_avg_fast_new");
    Expr m2 = b.name(b.state("exp_avg_slow") * b3_t + (1.0 - b3_t) * u, "exp_avg_slow_new");
    Expr nu = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg_fast", m1);
    b.set_state("exp_avg_slow", m2);
    b.set_state("exp_avg_sq", nu);
    Expr bc1 = b.name(1.0 - pow(b1, t), "bias_correction1");
    Expr bc2_sqrt = b.name(sqrt(1.0 - pow(b2, t)), "bias_correction2_sqrt");
    Expr denom = b.name(sqrt(nu) / bc2_sqrt + b.hyper("eps"), "denom");
    return (m1 / bc1 + alpha * m2) / denom;
  });
}

// Schedule-free AdamW (Defazio, Yang, Mehta, Mishchenko, Khaled, Cutkosky 2024, "The Road Less
// Scheduled"), as the schedulefree package's AdamWScheduleFree steps it (train mode: the parameter
// is y, the point the gradient is taken at). State z (the SGD-like sequence; starts as the
// parameter) and exp_avg_sq; x, the average, is not stored: y = (1-b1) z + b1 x. At step t (the
// group's step k + 1: the hyperparameter group_step where > 0, else this optimizer's step count):
//   sched = t / warmup_steps  while t - 1 < warmup_steps, else 1;   lr_t = lr * sched
//   exp_avg_sq = b2 exp_avg_sq + (1-b2) u^2
//   gn = u / (sqrt(exp_avg_sq / (1 - b2^t)) + eps) + weight_decay * y    (decay at y)
//   y  = lerp(y, z, ckp1) + lr_t (b1 (1 - ckp1) - 1) gn
//   z  = z - lr_t gn
// ckp1, the weight of the newest z in the average x, is weight / weight_sum with weight =
// t^r lr_max^weight_lr_power summed over the steps (lr_max the largest lr_t so far): a running sum
// over steps, kept by the caller and set every step (the torch class does). ckp1 < 0 (the default)
// is 1/t: that value when r = 0 and lr_t is constant (warmup_steps = 0 or weight_lr_power = 0).
// The order of operations is the reference's in-place one (lerp, then add), so it matches to float32
// rounding. This rule writes the parameter itself (param base and update): it is the whole optimizer,
// the last rule of a chain, and the only one that changes the parameter.
Rule schedule_free_adamw(double lr, double b1, double b2, double eps, double weight_decay, double warmup_steps) {
  Rule r("schedule_free_adamw");
  r.hyper("lr", lr, Range::non_negative()).hyper("b1", b1, kBeta).hyper("b2", b2, kBeta);
  r.hyper("eps", eps, Range::non_negative()).hyper("weight_decay", weight_decay);
  r.hyper("warmup_steps", warmup_steps, Range::non_negative());
  r.hyper("ckp1", -1.0, Range{-1e308, 1.0, false, false});
  r.hyper("group_step", 0.0, Range::non_negative());
  r.state_from_param("z").state("exp_avg_sq");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), y = b.param(), z = b.state("z");
    Expr t = b.name(select(b.hyper("group_step") > 0.0, b.hyper("group_step"), b.step()), "t");
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2"), warmup = b.hyper("warmup_steps");
    // Uniform (float64, as the reference's Python floats). warmup_steps = 0: the branch t / 0 is dropped.
    Expr sched = select(t - 1.0 < warmup, t / warmup, b.constant(1.0));
    Expr lr = b.name(b.hyper("lr") * sched, "scheduled_lr");
    Expr ckp1 = b.name(select(b.hyper("ckp1") < 0.0, 1.0 / t, b.hyper("ckp1")), "ckp1");
    Expr bc2 = b.name(1.0 - pow(b2, t), "bias_correction2");
    Expr y_coef = b.name(lr * (b1 * (1.0 - ckp1) - 1.0), "y_grad_coef");
    // Element (float32).
    Expr v = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg_sq", v);
    Expr denom = b.name(sqrt(v / bc2) + b.hyper("eps"), "denom");
    Expr gn = b.name(u / denom + b.hyper("weight_decay") * y, "grad_normalized");
    b.set_param_base(lerp(y, z, ckp1));
    b.set_state("z", b.name(z - lr * gn, "z_new"));
    return gn * y_coef;
  });
}

}  // namespace optfuse::rules
