// The moment updates of torch's Adam family, written once (float32 rounding as torch's in-place ops):
//   exp_avg.lerp_(u, 1 - b1)        exp_avg_sq.mul_(b2).addcmul_(u, u, value=1 - b2)
// Each reads the rule's state of that name; the caller stores the result with set_state.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::rules {

inline Expr new_exp_avg(RuleBuilder& b, Expr u, Expr b1) {
  return b.name(lerp(b.state("exp_avg"), u, 1.0 - b1), "exp_avg_new");
}

inline Expr new_exp_avg_sq(RuleBuilder& b, Expr u, Expr b2) {
  return b.name(b.state("exp_avg_sq") * b2 + (1.0 - b2) * u * u, "exp_avg_sq_new");
}

}  // namespace optfuse::rules
