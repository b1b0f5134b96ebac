// Rules whose state is factored over the rows and columns of each parameter's matrix view
// (TensorRef::cols): Adafactor.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::rules {

// torch.optim.Adafactor's update, including its lr-scaled step (rho, alpha) and update clipping;
// weight decay and maximize are rules of their own. eps1: torch's eps[0] (None there: the
// parameter dtype's machine epsilon, which the caller passes).
Rule scale_by_adafactor(double lr, double beta2_decay, double eps1, double eps2, double d);

}  // namespace optfuse::rules
