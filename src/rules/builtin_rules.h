// The built-in rules as plain C++ functions (the math); builtin_registry.cpp maps names and
// arguments onto them.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::rules {

Rule scale_by_adam(double b1, double b2, double eps, bool amsgrad);
Rule add_decayed_weights(double weight_decay);
Rule decoupled_weight_decay(double lr, double weight_decay);
Rule scale_by_learning_rate(double lr);
Rule scale(double factor);
Rule trace(double momentum, double dampening, bool nesterov);
Rule scale_by_lion(double b1, double b2);
Rule scale_by_rms(double alpha, double eps, bool centered);
Rule scale_by_adagrad(double eps, double initial_accumulator_value, double lr_decay);
Rule clip_by_global_norm(double max_norm);
Rule unscale_by_grad_scale();
Rule skip_if_nonfinite();
Rule scale_by_radam(double b1, double b2, double eps);
Rule scale_by_adamax(double b1, double b2, double eps);
Rule scale_by_adadelta(double rho, double eps);
Rule scale_by_rprop(double lr, double etaminus, double etaplus, double step_size_min, double step_size_max);
Rule averaged_sgd(double lr, double lambd, double alpha, double t0);
Rule scale_by_nadam(double lr, double b1, double b2, double eps, double momentum_decay);
Rule scale_by_ademamix(double b1, double b2, double b3, double alpha, double t_alpha, double t_beta3, double eps);
Rule schedule_free_adamw(double lr, double b1, double b2, double eps, double weight_decay, double warmup_steps);

}  // namespace optfuse::rules
