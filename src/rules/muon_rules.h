// Muon as a chain with a matrix phase (optfuse/matrix_chain.h runs it):
//   scale_by_muon_momentum -> newton_schulz (matrix rule) -> decoupled_weight_decay -> scale_by_muon_lr
// torch.optim.Muon's math, with optfuse's lerp and multiply-then-add roundings (the torch front end,
// optfuse/torch/_muon.py, reproduces torch's fused forms exactly; these are within an ulp per op).
#pragma once
#include "optfuse/rule.h"

namespace optfuse::rules {

// buf <- lerp(buf, u, 1 - momentum); the outgoing update is lerp(u, buf, momentum) with Nesterov,
// else buf (torch.optim.Muon's momentum; state momentum_buffer).
Rule scale_by_muon_momentum(double momentum, bool nesterov);
// The matrix rule: each tensor's update, a whole matrix, orthogonalised (NewtonSchulzOptions).
Rule newton_schulz(const NewtonSchulzOptions& options);
// torch.optim.Muon's adjust_lr_fn, as the per-tensor ratio adjusted_lr / lr of an A x B matrix.
enum class MuonLrAdjust : int { original = 0, match_rms_adamw = 1, spectral_unclamped = 2 };
// Multiplies the update by -lr * ratio(rows, cols) (the tensor's matrix view).
Rule scale_by_muon_lr(double lr, MuonLrAdjust adjust);

}  // namespace optfuse::rules
