// The math of LAMB and LARS as timm.optim (1.0) writes them, operation by operation where float32
// rounding depends on it, except that a division of every element by a uniform value (the clip
// divisor, the bias corrections) is a multiplication by its reciprocal (float64, rounded once): within
// an ulp of timm's and one instruction instead of an IEEE division sequence (those made LAMB's
// read-only norm pass arithmetic-bound on the H200: docs/performance.md). Norms are per-tensor reductions (float64, deterministic); the trust ratio
// is a per-tensor value computed in float64 and rounded to float32 where it meets the update, as
// timm's 0-dim float32 tensors are (so results match timm to about one float32 rounding per step).
#include "rules/layerwise_rules.h"

#include "rules/moments.h"

namespace optfuse::rules {

static const Range kBeta = Range::unit_interval_open_right();
static const Range kFlag{0, 1, false, false};

// 1 where a flag hyperparameter is set.
static Expr on(RuleBuilder& b, const char* flag) { return b.hyper(flag) != 0.0; }

// torch.where(w > 0, torch.where(g > 0, ratio, 1), 1)
static Expr guarded(Expr w_norm, Expr g_norm, Expr ratio) {
  Expr one = constant(*ratio.graph, 1.0);
  return select(w_norm > constant(*ratio.graph, 0.0), select(g_norm > constant(*ratio.graph, 0.0), ratio, one), one);
}

Rule clip_by_global_norm_ratio(double max_norm) {
  Rule r("clip_by_global_norm_ratio");
  r.hyper("max_norm", max_norm, Range::positive());
  return r.update([](RuleBuilder& b) {
    Expr u = b.update();
    Expr norm = b.name(sqrt(global_sum_of_squares(u)), "global_norm");
    Expr divisor = b.name(max(norm / b.hyper("max_norm"), 1.0), "clip_divisor");
    return u * b.name(1.0 / divisor, "clip_scale");
  });
}

Rule scale_by_lamb(const LambOptions& o) {
  Rule r("scale_by_lamb");
  r.hyper("b1", o.b1, kBeta).hyper("b2", o.b2, kBeta).hyper("eps", o.eps, Range::non_negative());
  r.hyper("weight_decay", o.weight_decay, Range::non_negative()).hyper("lr", o.lr, Range::non_negative());
  r.hyper("bias_correction", o.bias_correction, kFlag).hyper("grad_averaging", o.grad_averaging, kFlag);
  r.hyper("decoupled_decay", o.decoupled_decay, kFlag).hyper("trust_clip", o.trust_clip, kFlag);
  r.hyper("always_adapt", o.always_adapt, kFlag).hyper("max_lr", o.max_lr, Range::non_negative());
  r.state("exp_avg").state("exp_avg_sq");
  return r.update([](RuleBuilder& b) {
    Expr u = b.update(), t = b.step(), p = b.param();
    Expr b1 = b.hyper("b1"), b2 = b.hyper("b2"), wd = b.hyper("weight_decay"), lr = b.hyper("lr");
    // exp_avg.lerp_(g, 1 - b1) with grad averaging, else exp_avg.mul_(b1).add_(g)
    Expr m = b.name(select(on(b, "grad_averaging"), lerp(b.state("exp_avg"), u, 1.0 - b1), b.state("exp_avg") * b1 + u),
                    "exp_avg_new");
    Expr v = new_exp_avg_sq(b, u, b2);
    b.set_state("exp_avg", m);
    b.set_state("exp_avg_sq", v);
    Expr bc1 = b.name(select(on(b, "bias_correction"), 1.0 - pow(b1, t), b.constant(1.0)), "bias_correction1");
    Expr bc2_sqrt = b.name(sqrt(select(on(b, "bias_correction"), 1.0 - pow(b2, t), b.constant(1.0))), "bias_correction2_sqrt");
    Expr update = b.name((m * (1.0 / bc1)) / (sqrt(v) * (1.0 / bc2_sqrt) + b.hyper("eps")), "adam_update");
    Expr decays = wd != 0.0, decoupled = b.name(decays && on(b, "decoupled_decay"), "decoupled");
    // decoupled: p.add_(p, alpha=-wd_scale * wd) before the norms; else update.add_(p, alpha=wd)
    Expr wd_scale = select(b.hyper("max_lr") > 0.0, lr * lr / b.hyper("max_lr"), lr);
    Expr base = b.param_base();
    Expr decayed = select(decoupled, base + b.name(-(wd_scale * wd), "decoupled_decay_alpha") * base, base);
    b.set_param_base(decayed);
    update = select(decays && !decoupled, update + wd * p, update);
    Expr w_norm = b.name(sqrt(tensor_sum_of_squares(decayed)), "param_norm");
    Expr g_norm = b.name(sqrt(tensor_sum_of_squares(update)), "update_norm");
    Expr ratio = guarded(w_norm, g_norm, w_norm / g_norm);
    ratio = b.name(select(on(b, "trust_clip"), min(ratio, 1.0), ratio), "trust_ratio");
    return select(decays || on(b, "always_adapt"), update * ratio, update);
  });
}

Rule scale_by_lars(double trust_coeff, double eps, double weight_decay, bool trust_clip, bool always_adapt, double lr) {
  Rule r("scale_by_lars");
  r.hyper("trust_coeff", trust_coeff, Range::non_negative()).hyper("eps", eps, Range::non_negative());
  r.hyper("weight_decay", weight_decay, Range::non_negative()).hyper("trust_clip", trust_clip, kFlag);
  r.hyper("always_adapt", always_adapt, kFlag).hyper("lr", lr, Range::non_negative());
  return r.update([](RuleBuilder& b) {
    Expr g = b.update(), p = b.param(), wd = b.hyper("weight_decay");
    Expr w_norm = b.name(sqrt(tensor_sum_of_squares(p)), "param_norm");
    Expr g_norm = b.name(sqrt(tensor_sum_of_squares(g)), "grad_norm");
    Expr ratio = guarded(w_norm, g_norm, b.hyper("trust_coeff") * w_norm / (g_norm + w_norm * wd + b.hyper("eps")));
    ratio = b.name(select(on(b, "trust_clip"), min(ratio / b.hyper("lr"), 1.0), ratio), "trust_ratio");
    return select(wd != 0.0 || on(b, "always_adapt"), (g + wd * p) * ratio, g);
  });
}

}  // namespace optfuse::rules
