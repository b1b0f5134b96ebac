// The math of every built-in rule. Each follows torch's for-loop implementation's order of
// operations where it matters for float32 rounding (lerp for exp_avg, addcmul as (v*b2) +
// ((1-b2)*g)*g, bias corrections in float64 as uniform values), so that the drop-in optimizers
// match torch to rounding. `u` is the incoming update: the gradient for the first rule of a chain.
#include "rules/builtin_rules.h"

#include "optfuse/error.h"

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
    Expr m = b.name(lerp(b.state("exp_avg"), u, 1.0 - b1), "exp_avg_new");
    Expr v = b.name(b.state("exp_avg_sq") * b2 + (1.0 - b2) * u * u, "exp_avg_sq_new");
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

}  // namespace optfuse::rules
