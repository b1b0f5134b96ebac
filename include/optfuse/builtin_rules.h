// The built-in rules and named optimizers, by name, with their arguments and defaults.
// Named optimizers follow torch's argument names and defaults so that PyTorch users recognise them.
//
//   rule / optimizer        arguments (defaults)
//   scale_by_adam           b1=0.9 b2=0.999 eps=1e-8 amsgrad=false   (betas=(b1, b2) also accepted)
//   add_decayed_weights     weight_decay=0           (adds weight_decay * param to the update: L2, as Adam)
//   decoupled_weight_decay  lr=1e-3 weight_decay=0   (param *= 1 - lr * weight_decay: AdamW, Lion)
//   scale_by_learning_rate  lr=1e-3                  (multiplies the update by -lr)
//   scale                   factor (required)
//   trace                   momentum=0.9 dampening=0 nesterov=false
//   scale_by_lion           b1=0.9 b2=0.99
//   scale_by_rms            alpha=0.99 eps=1e-8 centered=false
//   scale_by_adagrad        eps=1e-10 initial_accumulator_value=0 lr_decay=0
//   clip_by_global_norm     max_norm=1.0
//   unscale_by_grad_scale   (none)                   (divides by the grad_scale global; skips on found_inf)
//   skip_if_nonfinite       (none)                   (skips the whole step if any update is inf/NaN)
//   scale_by_radam          b1=0.9 b2=0.999 eps=1e-8 (RAdam's rectified update, without lr)
//   scale_by_adamax         b1=0.9 b2=0.999 eps=1e-8 (exp_avg / (1-b1^t) / exp_inf, exp_inf the decayed max of |u|)
//   scale_by_adadelta       rho=0.9 eps=1e-6         (Adadelta's delta, without lr)
//   scale_by_rprop          lr=1e-2 etaminus=0.5 etaplus=1.2 step_size_min=1e-6 step_size_max=50
//                                                    (sign(u) * per-element step size; step sizes start at lr)
//   averaged_sgd            lr=1e-2 lambd=1e-4 alpha=0.75 t0=1e6   (ASGD: decays and steps the parameter,
//                                                    keeps the average ax; uniform states eta and mu (per
//                                                    group, init lr and 1, torch's per-parameter scalars);
//                                                    must be the last rule of a chain)
//   scale_by_nadam          lr=2e-3 b1=0.9 b2=0.999 eps=1e-8 momentum_decay=4e-3   (NAdam's two-term update
//                                                    with lr; uniform state mu_product (per group, init 1);
//                                                    must be the last rule of a chain)
//   clip_by_global_norm_ratio  max_norm=1.0         (u / max(global_norm / max_norm, 1): timm's Lamb clipping)
//   scale_by_lamb           as lamb below, less max_grad_norm (per-tensor trust ratio ||p|| / ||update||)
//   scale_by_lars           trust_coeff=0.001 eps=1e-8 weight_decay=0 trust_clip=false always_adapt=false lr=1.0
//   scale_by_ademamix       b1=0.9 b2=0.999 b3=0.9999 alpha=2 t_alpha=0 t_beta3=0 eps=1e-8
//                                                    (AdEMAMix's mixed fast/slow EMA update, without lr;
//                                                    t_alpha, t_beta3: warm-up steps of alpha and b3, 0 = none)
//   schedule_free_adamw     lr=0.0025 b1=0.9 b2=0.999 eps=1e-8 weight_decay=0 warmup_steps=0
//                                                    (schedulefree's AdamWScheduleFree step in train mode; states z
//                                                    (starts as the parameter), exp_avg_sq; hyperparameters set per
//                                                    step: ckp1=-1 (1/t), group_step=0 (the step count))
//   scale_by_adafactor      lr=1e-2 beta2_decay=-0.8 eps1=1.1920928955078125e-07 eps2=1e-3 d=1
//                                                    (torch's Adafactor step with rho, alpha and clipping; states
//                                                    row_var (per row) and col_var (per column) of each
//                                                    parameter's matrix view, TensorRef::cols; a parameter
//                                                    without a view keeps one value per element in row_var)
//   scale_by_muon_momentum momentum=0.95 nesterov=true   (torch.optim.Muon's momentum; state momentum_buffer)
//   newton_schulz           ns_coefficients=(3.4445,-4.775,2.0315) ns_steps=5 eps=1e-7   (a matrix rule: each
//                                                    tensor's update orthogonalised; optfuse/matrix_chain.h)
//   scale_by_muon_lr        lr=1e-3 adjust_lr=0      (update * -lr * ratio(rows, cols); adjust_lr 0 original,
//                                                    1 match_rms_adamw, 2 spectral_unclamped)
//   sgd      lr=1e-3 momentum=0 dampening=0 weight_decay=0 nesterov=false maximize=false
//   adam     lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0 amsgrad=false maximize=false
//   adamw    lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=1e-2 amsgrad=false maximize=false
//   lion     lr=1e-4 betas=(0.9,0.99) weight_decay=0
//   rmsprop  lr=1e-2 alpha=0.99 eps=1e-8 weight_decay=0 momentum=0 centered=false maximize=false
//   adagrad  lr=1e-2 lr_decay=0 weight_decay=0 initial_accumulator_value=0 eps=1e-10 maximize=false
//   radam    lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0 decoupled_weight_decay=false maximize=false
//   adamax   lr=2e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0 maximize=false
//   adadelta lr=1.0 rho=0.9 eps=1e-6 weight_decay=0 maximize=false
//   rprop    lr=1e-2 etas=(0.5,1.2) step_sizes=(1e-6,50) maximize=false   (chain ends with scale(-1))
//   nadam    lr=2e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0 momentum_decay=4e-3 decoupled_weight_decay=false
//            maximize=false
//   asgd     lr=1e-2 lambd=1e-4 alpha=0.75 t0=1e6 weight_decay=0 maximize=false
//   lamb     lr=1e-3 bias_correction=true betas=(0.9,0.999) eps=1e-6 weight_decay=0.01 grad_averaging=true
//            max_grad_norm=1.0 (0: none) trust_clip=false always_adapt=false decoupled_decay=false max_lr=0
//            (timm.optim.Lamb; max_lr > 0 is its corrected_weight_decay with max_lr_snapshot)
//   ademamix lr=1e-3 betas=(0.9,0.999,0.9999) alpha=2 t_beta3=0 t_alpha=0 eps=1e-8 weight_decay=0
//            (apple/ml-ademamix's AdEMAMix: p -= lr * (update + weight_decay * p); b1=, b2=, b3= also accepted)
//   adamw_schedule_free lr=0.0025 betas=(0.9,0.999) eps=1e-8 weight_decay=0 warmup_steps=0
//            (schedulefree.AdamWScheduleFree; its r and weight_lr_power live in the averaging weight ckp1)
//   adafactor lr=1e-2 beta2_decay=-0.8 eps=(1.1920928955078125e-07,1e-3) d=1 weight_decay=0 maximize=false
//            (torch.optim.Adafactor; eps[0]: torch's None is the parameters' machine epsilon)
//   lars     lr=1.0 momentum=0 dampening=0 weight_decay=0 nesterov=false trust_coeff=0.001 eps=1e-8
//            trust_clip=false always_adapt=false (timm.optim.Lars)
//   muon     lr=1e-3 weight_decay=0.1 momentum=0.95 nesterov=true ns_coefficients=(3.4445,-4.775,2.0315)
//            eps=1e-7 ns_steps=5 adjust_lr=0 (torch.optim.Muon: a chain with a matrix phase, which
//            MatrixChainOptimizer runs, optfuse/matrix_chain.h)
#pragma once
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "optfuse/rule.h"

namespace optfuse {

// An argument value: a number, a boolean or a pair of numbers (betas).
struct ArgValue {
  enum class Kind { Number, Bool, Pair } kind = Kind::Number;
  double number = 0;
  bool boolean = false;
  std::vector<double> pair;
  ArgValue() = default;
  ArgValue(double v) : kind(Kind::Number), number(v) {}            // NOLINT: implicit on purpose
  ArgValue(int v) : kind(Kind::Number), number(v) {}               // NOLINT
  ArgValue(bool v) : kind(Kind::Bool), boolean(v) {}               // NOLINT
  ArgValue(std::initializer_list<double> v) : kind(Kind::Pair), pair(v) {}  // NOLINT
  explicit ArgValue(std::vector<double> v) : kind(Kind::Pair), pair(std::move(v)) {}
};
using Args = std::map<std::string, ArgValue>;

// Builds a built-in rule or named optimizer as a chain. Throws optfuse::Error for an unknown name
// or argument (with the closest known one), a value of the wrong kind, or an invalid value.
Chain make_builtin(const std::string& name, const Args& args = {});
// Positional arguments in the order make_builtin takes them (spec text allows them).
std::vector<std::string> builtin_parameter_names(const std::string& name);
std::vector<std::string> builtin_names();

// Parses SPEC text ("chain(clip_by_global_norm(1.0), adamw(lr=1e-3))") into a chain. Errors give
// the position in the text.
Chain parse_chain(const std::string& spec);

inline Chain sgd(const Args& a = {}) { return make_builtin("sgd", a); }
inline Chain adam(const Args& a = {}) { return make_builtin("adam", a); }
inline Chain adamw(const Args& a = {}) { return make_builtin("adamw", a); }
inline Chain lion(const Args& a = {}) { return make_builtin("lion", a); }
inline Chain rmsprop(const Args& a = {}) { return make_builtin("rmsprop", a); }
inline Chain adagrad(const Args& a = {}) { return make_builtin("adagrad", a); }
inline Chain radam(const Args& a = {}) { return make_builtin("radam", a); }
inline Chain adamax(const Args& a = {}) { return make_builtin("adamax", a); }
inline Chain adadelta(const Args& a = {}) { return make_builtin("adadelta", a); }
inline Chain rprop(const Args& a = {}) { return make_builtin("rprop", a); }
inline Chain asgd(const Args& a = {}) { return make_builtin("asgd", a); }
inline Chain ademamix(const Args& a = {}) { return make_builtin("ademamix", a); }
inline Chain adafactor(const Args& a = {}) { return make_builtin("adafactor", a); }
inline Chain adamw_schedule_free(const Args& a = {}) { return make_builtin("adamw_schedule_free", a); }
inline Chain clip_by_global_norm(double max_norm) { return make_builtin("clip_by_global_norm", {{"max_norm", max_norm}}); }

}  // namespace optfuse
