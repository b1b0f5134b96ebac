#include "rules/muon_rules.h"

#include "optfuse/error.h"

namespace optfuse::rules {

Rule scale_by_muon_momentum(double momentum, bool nesterov) {
  Rule r("scale_by_muon_momentum");
  r.hyper("momentum", momentum, Range::non_negative()).hyper("nesterov", nesterov ? 1.0 : 0.0, {0, 1, false, false});
  r.state("momentum_buffer");
  return r.update([](RuleBuilder& b) {
    Expr g = b.update(), mom = b.hyper("momentum");
    Expr buf = b.name(lerp(b.state("momentum_buffer"), g, 1.0 - mom), "momentum_buffer_new");
    b.set_state("momentum_buffer", buf);
    return b.name(select(b.hyper("nesterov") != 0.0, lerp(g, buf, mom), buf), "muon_update");
  });
}

Rule newton_schulz(const NewtonSchulzOptions& options) { return Rule("newton_schulz").matrix_phase(options); }

Rule scale_by_muon_lr(double lr, MuonLrAdjust adjust) {
  if (adjust != MuonLrAdjust::original && adjust != MuonLrAdjust::match_rms_adamw &&
      adjust != MuonLrAdjust::spectral_unclamped)
    throw Error("scale_by_muon_lr: adjust_lr must be 0 (original), 1 (match_rms_adamw) or 2 (spectral_unclamped)");
  Rule r("scale_by_muon_lr");
  r.hyper("lr", lr, Range::non_negative()).hyper("adjust_lr", static_cast<double>(adjust), {0, 2, false, false});
  return r.update([](RuleBuilder& b) {
    // torch.optim.Muon's _adjust_lr with A, B = the matrix's rows and columns (per tensor, float64)
    Expr rows = b.shape(ShapeItem::Rows), cols = b.shape(ShapeItem::Cols), adjust = b.hyper("adjust_lr");
    Expr original = sqrt(max(rows / cols, 1.0));
    Expr rms = 0.2 * sqrt(max(rows, cols));
    Expr spectral = sqrt(rows / cols);
    Expr ratio = select(adjust == 0.0, original, select(adjust == 1.0, rms, spectral));
    return b.update() * b.name(-(b.hyper("lr") * ratio), "adjusted_step");
  });
}

}  // namespace optfuse::rules
