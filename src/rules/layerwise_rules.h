// Rules whose update is scaled per tensor (layer-wise adaptation): LAMB and LARS as timm.optim
// writes them, and timm's global-norm clipping. The math is in layerwise_rules.cpp.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::rules {

// u / max(||u||_global / max_norm, 1): timm's Lamb clipping (a divisor, unlike
// clip_by_global_norm's torch.nn.utils.clip_grad_norm_ coefficient max_norm / (norm + 1e-6)).
Rule clip_by_global_norm_ratio(double max_norm);

struct LambOptions {
  double b1 = 0.9, b2 = 0.999, eps = 1e-6, weight_decay = 0.01, lr = 1e-3;
  bool bias_correction = true, grad_averaging = true, decoupled_decay = false, trust_clip = false,
       always_adapt = false;
  double max_lr = 0;  // > 0: timm's corrected_weight_decay (decoupled decay scaled by lr^2 / max_lr)
};
// timm.optim.Lamb's update after clipping, without the final -lr: Adam moments, weight decay
// (added to the update, or decoupled from the parameter), then the trust ratio
// ||param|| / ||update|| per tensor. Every option is a hyperparameter (0/1 for booleans), so
// parameter groups that differ only in options share one kernel and one global norm.
Rule scale_by_lamb(const LambOptions& o);

// timm.optim.Lars's trust ratio on the gradient, per tensor:
// trust_coeff * ||p|| / (||g|| + wd * ||p|| + eps), applied to g + wd * p (LARC's clip with trust_clip).
Rule scale_by_lars(double trust_coeff, double eps, double weight_decay, bool trust_clip, bool always_adapt, double lr);

}  // namespace optfuse::rules
