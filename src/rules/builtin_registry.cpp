// Names -> built-in rules and named optimizers, with argument schemas (kinds, defaults, order) so
// that C++ callers, SPEC text and the Python package all get the same names, defaults and errors.
#include <algorithm>
#include <functional>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "rules/builtin_rules.h"
#include "rules/factored_rules.h"
#include "rules/layerwise_rules.h"
#include "rules/muon_rules.h"
#include "rules/suggest.h"
#include "spec/spec_parser.h"

namespace optfuse {

namespace {

struct Param {
  std::string name;
  ArgValue def;
  bool required = false;
};

// Resolved arguments: every schema parameter has a value of the right kind.
class Resolved {
 public:
  std::map<std::string, ArgValue> v;
  double num(const std::string& n) const { return v.at(n).number; }
  bool flag(const std::string& n) const { return v.at(n).boolean; }
  double beta(int i) const { return pair("betas", i); }
  double pair(const std::string& n, int i) const { return v.at(n).pair.at(static_cast<size_t>(i)); }
};

struct Builtin {
  std::vector<Param> params;
  std::function<Chain(const Resolved&)> make;
};

const char* kind_name(ArgValue::Kind k) {
  switch (k) {
    case ArgValue::Kind::Number: return "a number";
    case ArgValue::Kind::Bool: return "true or false";
    case ArgValue::Kind::Pair: return "a pair of numbers like (0.9, 0.999)";
  }
  return "?";
}

// torch.finfo(torch.float32).eps: Adafactor's eps1 when torch's is None (float32 parameters).
constexpr double kFloat32Eps = 1.1920928955078125e-07;

const std::vector<Param> kAdamParams = {{"lr", 1e-3},           {"betas", {0.9, 0.999}},
                                        {"eps", 1e-8},          {"weight_decay", 0.0},
                                        {"amsgrad", false},     {"maximize", false}};

const std::vector<Param> kLambParams = {
    {"lr", 1e-3},          {"bias_correction", true},  {"betas", {0.9, 0.999}}, {"eps", 1e-6},
    {"weight_decay", 0.01}, {"grad_averaging", true},  {"max_grad_norm", 1.0},   {"trust_clip", false},
    {"always_adapt", false}, {"decoupled_decay", false}, {"max_lr", 0.0}};

rules::LambOptions lamb_options(const Resolved& a) {
  rules::LambOptions o;
  o.b1 = a.beta(0);
  o.b2 = a.beta(1);
  o.eps = a.num("eps");
  o.weight_decay = a.num("weight_decay");
  o.lr = a.num("lr");
  o.bias_correction = a.flag("bias_correction");
  o.grad_averaging = a.flag("grad_averaging");
  o.decoupled_decay = a.flag("decoupled_decay");
  o.trust_clip = a.flag("trust_clip");
  o.always_adapt = a.flag("always_adapt");
  o.max_lr = a.num("max_lr");
  return o;
}

NewtonSchulzOptions ns_options(const Resolved& a) {
  const std::vector<double>& c = a.v.at("ns_coefficients").pair;  // three numbers, as its default (checked)
  const double steps = a.num("ns_steps");
  if (steps != static_cast<int>(steps)) throw Error("ns_steps must be a whole number");
  NewtonSchulzOptions o;
  o.coefficients = {c[0], c[1], c[2]};
  o.steps = static_cast<int>(steps);
  o.eps = a.num("eps");
  return o;
}

rules::MuonLrAdjust muon_lr_adjust(const Resolved& a) {
  const double v = a.num("adjust_lr");
  if (v != 0 && v != 1 && v != 2)
    throw Error("adjust_lr must be 0 (original), 1 (match_rms_adamw) or 2 (spectral_unclamped)");
  return static_cast<rules::MuonLrAdjust>(static_cast<int>(v));
}

// maximize (negate the gradient) and, where l2, L2 weight decay (add weight_decay * param), in
// torch's order, as the first rules of the named optimizers (l2 = false: decoupled decay, applied
// later, or an optimizer without weight_decay).
Chain maximize_and_l2(const Resolved& a, bool l2 = true) {
  Chain c;
  if (a.flag("maximize")) c.push_back(rules::scale(-1.0));
  if (l2 && a.num("weight_decay") != 0) c.push_back(rules::add_decayed_weights(a.num("weight_decay")));
  return c;
}

Chain adam_like(const Resolved& a, bool decoupled) {
  Chain c = maximize_and_l2(a, !decoupled);
  c.push_back(rules::scale_by_adam(a.beta(0), a.beta(1), a.num("eps"), a.flag("amsgrad")));
  if (decoupled && a.num("weight_decay") != 0)
    c.push_back(rules::decoupled_weight_decay(a.num("lr"), a.num("weight_decay")));
  c.push_back(rules::scale_by_learning_rate(a.num("lr")));
  return c;
}

const std::map<std::string, Builtin>& registry() {
  static const std::map<std::string, Builtin> r = {
      {"scale_by_adam",
       {{{"b1", 0.9}, {"b2", 0.999}, {"eps", 1e-8}, {"amsgrad", false}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_adam(a.num("b1"), a.num("b2"), a.num("eps"), a.flag("amsgrad"))};
        }}},
      {"decoupled_weight_decay",
       {{{"lr", 1e-3}, {"weight_decay", 0.0}},
        [](const Resolved& a) { return Chain{rules::decoupled_weight_decay(a.num("lr"), a.num("weight_decay"))}; }}},
      {"add_decayed_weights",
       {{{"weight_decay", 0.0}}, [](const Resolved& a) { return Chain{rules::add_decayed_weights(a.num("weight_decay"))}; }}},
      {"scale_by_learning_rate",
       {{{"lr", 1e-3}}, [](const Resolved& a) { return Chain{rules::scale_by_learning_rate(a.num("lr"))}; }}},
      {"scale", {{{"factor", 0.0, true}}, [](const Resolved& a) { return Chain{rules::scale(a.num("factor"))}; }}},
      {"trace",
       {{{"momentum", 0.9}, {"dampening", 0.0}, {"nesterov", false}},
        [](const Resolved& a) {
          return Chain{rules::trace(a.num("momentum"), a.num("dampening"), a.flag("nesterov"))};
        }}},
      {"scale_by_lion",
       {{{"b1", 0.9}, {"b2", 0.99}}, [](const Resolved& a) { return Chain{rules::scale_by_lion(a.num("b1"), a.num("b2"))}; }}},
      {"scale_by_rms",
       {{{"alpha", 0.99}, {"eps", 1e-8}, {"centered", false}},
        [](const Resolved& a) { return Chain{rules::scale_by_rms(a.num("alpha"), a.num("eps"), a.flag("centered"))}; }}},
      {"scale_by_adagrad",
       {{{"eps", 1e-10}, {"initial_accumulator_value", 0.0}, {"lr_decay", 0.0}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_adagrad(a.num("eps"), a.num("initial_accumulator_value"), a.num("lr_decay"))};
        }}},
      {"clip_by_global_norm",
       {{{"max_norm", 1.0}}, [](const Resolved& a) { return Chain{rules::clip_by_global_norm(a.num("max_norm"))}; }}},
      {"unscale_by_grad_scale", {{}, [](const Resolved&) { return Chain{rules::unscale_by_grad_scale()}; }}},
      {"skip_if_nonfinite", {{}, [](const Resolved&) { return Chain{rules::skip_if_nonfinite()}; }}},
      {"sgd",
       {{{"lr", 1e-3}, {"momentum", 0.0}, {"dampening", 0.0}, {"weight_decay", 0.0}, {"nesterov", false}, {"maximize", false}},
        [](const Resolved& a) {
          if (a.flag("nesterov") && (a.num("momentum") <= 0 || a.num("dampening") != 0))
            throw Error("sgd: nesterov=true requires momentum > 0 and dampening = 0");
          Chain c = maximize_and_l2(a);
          if (a.num("momentum") != 0)
            c.push_back(rules::trace(a.num("momentum"), a.num("dampening"), a.flag("nesterov")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"adam", {kAdamParams, [](const Resolved& a) { return adam_like(a, false); }}},
      {"adamw",
       {{{"lr", 1e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 1e-2}, {"amsgrad", false}, {"maximize", false}},
        [](const Resolved& a) { return adam_like(a, true); }}},
      {"lion",
       {{{"lr", 1e-4}, {"betas", {0.9, 0.99}}, {"weight_decay", 0.0}},
        [](const Resolved& a) {
          Chain c{rules::scale_by_lion(a.beta(0), a.beta(1))};
          if (a.num("weight_decay") != 0)
            c.push_back(rules::decoupled_weight_decay(a.num("lr"), a.num("weight_decay")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"rmsprop",
       {{{"lr", 1e-2}, {"alpha", 0.99}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"momentum", 0.0}, {"centered", false}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a);
          c.push_back(rules::scale_by_rms(a.num("alpha"), a.num("eps"), a.flag("centered")));
          if (a.num("momentum") != 0) c.push_back(rules::trace(a.num("momentum"), 0.0, false));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"clip_by_global_norm_ratio",
       {{{"max_norm", 1.0}}, [](const Resolved& a) { return Chain{rules::clip_by_global_norm_ratio(a.num("max_norm"))}; }}},
      {"scale_by_lamb",
       {{kLambParams.begin(), kLambParams.end()},
        [](const Resolved& a) { return Chain{rules::scale_by_lamb(lamb_options(a))}; }}},
      {"scale_by_lars",
       {{{"trust_coeff", 0.001}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"trust_clip", false}, {"always_adapt", false},
         {"lr", 1.0}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_lars(a.num("trust_coeff"), a.num("eps"), a.num("weight_decay"),
                                            a.flag("trust_clip"), a.flag("always_adapt"), a.num("lr"))};
        }}},
      // timm.optim.Lamb; max_grad_norm=0 turns the global clipping off (timm's None).
      {"lamb",
       {kLambParams,
        [](const Resolved& a) {
          if (a.num("max_grad_norm") < 0) throw Error("lamb: max_grad_norm must be >= 0 (0: no clipping)");
          Chain c;
          if (a.num("max_grad_norm") > 0) c.push_back(rules::clip_by_global_norm_ratio(a.num("max_grad_norm")));
          c.push_back(rules::scale_by_lamb(lamb_options(a)));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      // timm.optim.Lars
      {"lars",
       {{{"lr", 1.0}, {"momentum", 0.0}, {"dampening", 0.0}, {"weight_decay", 0.0}, {"nesterov", false},
         {"trust_coeff", 0.001}, {"eps", 1e-8}, {"trust_clip", false}, {"always_adapt", false}},
        [](const Resolved& a) {
          if (a.flag("nesterov") && (a.num("momentum") <= 0 || a.num("dampening") != 0))
            throw Error("lars: nesterov=true requires momentum > 0 and dampening = 0");
          Chain c{rules::scale_by_lars(a.num("trust_coeff"), a.num("eps"), a.num("weight_decay"), a.flag("trust_clip"),
                                       a.flag("always_adapt"), a.num("lr"))};
          if (a.num("momentum") != 0) c.push_back(rules::trace(a.num("momentum"), a.num("dampening"), a.flag("nesterov")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"adagrad",
       {{{"lr", 1e-2}, {"lr_decay", 0.0}, {"weight_decay", 0.0}, {"initial_accumulator_value", 0.0}, {"eps", 1e-10}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a);
          c.push_back(rules::scale_by_adagrad(a.num("eps"), a.num("initial_accumulator_value"), a.num("lr_decay")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"scale_by_radam",
       {{{"b1", 0.9}, {"b2", 0.999}, {"eps", 1e-8}},
        [](const Resolved& a) { return Chain{rules::scale_by_radam(a.num("b1"), a.num("b2"), a.num("eps"))}; }}},
      {"scale_by_adamax",
       {{{"b1", 0.9}, {"b2", 0.999}, {"eps", 1e-8}},
        [](const Resolved& a) { return Chain{rules::scale_by_adamax(a.num("b1"), a.num("b2"), a.num("eps"))}; }}},
      {"scale_by_adadelta",
       {{{"rho", 0.9}, {"eps", 1e-6}},
        [](const Resolved& a) { return Chain{rules::scale_by_adadelta(a.num("rho"), a.num("eps"))}; }}},
      {"scale_by_rprop",
       {{{"lr", 1e-2}, {"etaminus", 0.5}, {"etaplus", 1.2}, {"step_size_min", 1e-6}, {"step_size_max", 50.0}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_rprop(a.num("lr"), a.num("etaminus"), a.num("etaplus"), a.num("step_size_min"),
                                             a.num("step_size_max"))};
        }}},
      {"averaged_sgd",
       {{{"lr", 1e-2}, {"lambd", 1e-4}, {"alpha", 0.75}, {"t0", 1e6}},
        [](const Resolved& a) {
          return Chain{rules::averaged_sgd(a.num("lr"), a.num("lambd"), a.num("alpha"), a.num("t0"))};
        }}},
      {"scale_by_nadam",
       {{{"lr", 2e-3}, {"b1", 0.9}, {"b2", 0.999}, {"eps", 1e-8}, {"momentum_decay", 4e-3}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_nadam(a.num("lr"), a.num("b1"), a.num("b2"), a.num("eps"), a.num("momentum_decay"))};
        }}},
      {"nadam",
       {{{"lr", 2e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"momentum_decay", 4e-3},
         {"decoupled_weight_decay", false}, {"maximize", false}},
        [](const Resolved& a) {
          bool decoupled = a.flag("decoupled_weight_decay");
          double wd = a.num("weight_decay");
          Chain c = maximize_and_l2(a, !decoupled);
          if (decoupled && wd != 0) c.push_back(rules::decoupled_weight_decay(a.num("lr"), wd));
          c.push_back(rules::scale_by_nadam(a.num("lr"), a.beta(0), a.beta(1), a.num("eps"), a.num("momentum_decay")));
          return c;
        }}},
      {"scale_by_ademamix",
       {{{"b1", 0.9}, {"b2", 0.999}, {"b3", 0.9999}, {"alpha", 2.0}, {"t_alpha", 0.0}, {"t_beta3", 0.0}, {"eps", 1e-8}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_ademamix(a.num("b1"), a.num("b2"), a.num("b3"), a.num("alpha"), a.num("t_alpha"),
                                                a.num("t_beta3"), a.num("eps"))};
        }}},
      // AdEMAMix as its reference implementation (apple/ml-ademamix): betas=(b1, b2, b3); the
      // warm-ups t_beta3 / t_alpha (its beta3_warmup / alpha_warmup; 0 for its None: no warm-up);
      // weight decay added to the update before lr scales it (p -= lr * (update + wd * p)).
      {"ademamix",
       {{{"lr", 1e-3}, {"betas", {0.9, 0.999, 0.9999}}, {"alpha", 2.0}, {"t_beta3", 0.0}, {"t_alpha", 0.0},
         {"eps", 1e-8}, {"weight_decay", 0.0}},
        [](const Resolved& a) {
          Chain c{rules::scale_by_ademamix(a.beta(0), a.beta(1), a.beta(2), a.num("alpha"), a.num("t_alpha"),
                                           a.num("t_beta3"), a.num("eps"))};
          if (a.num("weight_decay") != 0) c.push_back(rules::add_decayed_weights(a.num("weight_decay")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      // Muon (torch.optim.Muon) and its parts: a chain with a matrix phase, which
      // MatrixChainOptimizer runs (optfuse/matrix_chain.h); adjust_lr: 0 original, 1
      // match_rms_adamw, 2 spectral_unclamped (torch's adjust_lr_fn None/"original", ...).
      {"scale_by_muon_momentum",
       {{{"momentum", 0.95}, {"nesterov", true}},
        [](const Resolved& a) { return Chain{rules::scale_by_muon_momentum(a.num("momentum"), a.flag("nesterov"))}; }}},
      {"newton_schulz",
       {{{"ns_coefficients", {3.4445, -4.7750, 2.0315}}, {"ns_steps", 5.0}, {"eps", 1e-7}},
        [](const Resolved& a) { return Chain{rules::newton_schulz(ns_options(a))}; }}},
      {"scale_by_muon_lr",
       {{{"lr", 1e-3}, {"adjust_lr", 0.0}},
        [](const Resolved& a) { return Chain{rules::scale_by_muon_lr(a.num("lr"), muon_lr_adjust(a))}; }}},
      {"muon",
       {{{"lr", 1e-3}, {"weight_decay", 0.1}, {"momentum", 0.95}, {"nesterov", true},
         {"ns_coefficients", {3.4445, -4.7750, 2.0315}}, {"eps", 1e-7}, {"ns_steps", 5.0}, {"adjust_lr", 0.0}},
        [](const Resolved& a) {
          Chain c{rules::scale_by_muon_momentum(a.num("momentum"), a.flag("nesterov")), rules::newton_schulz(ns_options(a))};
          if (a.num("weight_decay") != 0) c.push_back(rules::decoupled_weight_decay(a.num("lr"), a.num("weight_decay")));
          c.push_back(rules::scale_by_muon_lr(a.num("lr"), muon_lr_adjust(a)));
          return c;
        }}},
      {"schedule_free_adamw",
       {{{"lr", 0.0025}, {"b1", 0.9}, {"b2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"warmup_steps", 0.0}},
        [](const Resolved& a) {
          return Chain{rules::schedule_free_adamw(a.num("lr"), a.num("b1"), a.num("b2"), a.num("eps"),
                                                  a.num("weight_decay"), a.num("warmup_steps"))};
        }}},
      // Schedule-free AdamW as the schedulefree package's AdamWScheduleFree (train mode: the
      // parameter is y): its arguments and defaults, less r and weight_lr_power, which only shape
      // the averaging weight ckp1 (a hyperparameter the caller sets each step; its default -1 is
      // 1/t, right for r = 0 without warm-up). Decay is applied at y, inside the rule.
      {"adamw_schedule_free",
       {{{"lr", 0.0025}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"warmup_steps", 0.0}},
        [](const Resolved& a) {
          return Chain{rules::schedule_free_adamw(a.num("lr"), a.beta(0), a.beta(1), a.num("eps"), a.num("weight_decay"),
                                                  a.num("warmup_steps"))};
        }}},
      {"radam",
       {{{"lr", 1e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"decoupled_weight_decay", false},
         {"maximize", false}},
        [](const Resolved& a) {
          bool decoupled = a.flag("decoupled_weight_decay");
          double wd = a.num("weight_decay");
          Chain c = maximize_and_l2(a, !decoupled);
          c.push_back(rules::scale_by_radam(a.beta(0), a.beta(1), a.num("eps")));
          if (decoupled && wd != 0) c.push_back(rules::decoupled_weight_decay(a.num("lr"), wd));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"adamax",
       {{{"lr", 2e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.0}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a);
          c.push_back(rules::scale_by_adamax(a.beta(0), a.beta(1), a.num("eps")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"adadelta",
       {{{"lr", 1.0}, {"rho", 0.9}, {"eps", 1e-6}, {"weight_decay", 0.0}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a);
          c.push_back(rules::scale_by_adadelta(a.num("rho"), a.num("eps")));
          c.push_back(rules::scale_by_learning_rate(a.num("lr")));
          return c;
        }}},
      {"rprop",
       {{{"lr", 1e-2}, {"etas", {0.5, 1.2}}, {"step_sizes", {1e-6, 50.0}}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a, false);
          c.push_back(rules::scale_by_rprop(a.num("lr"), a.pair("etas", 0), a.pair("etas", 1), a.pair("step_sizes", 0),
                                            a.pair("step_sizes", 1)));
          c.push_back(rules::scale(-1.0));
          return c;
        }}},
      {"scale_by_adafactor",
       {{{"lr", 1e-2}, {"beta2_decay", -0.8}, {"eps1", kFloat32Eps}, {"eps2", 1e-3}, {"d", 1.0}},
        [](const Resolved& a) {
          return Chain{rules::scale_by_adafactor(a.num("lr"), a.num("beta2_decay"), a.num("eps1"), a.num("eps2"), a.num("d"))};
        }}},
      {"adafactor",
       {{{"lr", 1e-2}, {"beta2_decay", -0.8}, {"eps", {kFloat32Eps, 1e-3}}, {"d", 1.0}, {"weight_decay", 0.0},
         {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a, false);
          c.push_back(rules::scale_by_adafactor(a.num("lr"), a.num("beta2_decay"), a.pair("eps", 0), a.pair("eps", 1),
                                                a.num("d")));
          // torch: param.mul_(1 - lr * weight_decay) before the update is added
          if (a.num("weight_decay") != 0) c.push_back(rules::decoupled_weight_decay(a.num("lr"), a.num("weight_decay")));
          return c;
        }}},
      {"asgd",
       {{{"lr", 1e-2}, {"lambd", 1e-4}, {"alpha", 0.75}, {"t0", 1e6}, {"weight_decay", 0.0}, {"maximize", false}},
        [](const Resolved& a) {
          Chain c = maximize_and_l2(a);
          c.push_back(rules::averaged_sgd(a.num("lr"), a.num("lambd"), a.num("alpha"), a.num("t0")));
          return c;
        }}},
  };
  return r;
}

const Builtin& lookup(const std::string& name) {
  auto it = registry().find(name);
  if (it == registry().end())
    throw Error("unknown rule '" + name + "'" + suggestion(name, builtin_names()) +
                " (known: " + join_names(builtin_names(), 1) + ")");
  return it->second;
}

}  // namespace

std::vector<std::string> builtin_names() {
  std::vector<std::string> out;
  for (auto& kv : registry()) out.push_back(kv.first);
  return out;
}

std::vector<std::string> builtin_parameter_names(const std::string& name) {
  std::vector<std::string> out;
  for (auto& p : lookup(name).params) out.push_back(p.name);
  return out;
}

Chain make_builtin(const std::string& name, const Args& args) {
  const Builtin& b = lookup(name);
  Resolved r;
  std::vector<std::string> known;
  for (auto& p : b.params) {
    known.push_back(p.name);
    r.v[p.name] = p.def;
  }
  // betas: two numbers (Adam's), or three (AdEMAMix's); b1=, b2= (b3=) are accepted for them.
  const size_t num_betas = r.v.count("betas") ? r.v["betas"].pair.size() : 0;
  const std::vector<std::string> beta_names = {"b1", "b2", "b3"};
  for (size_t i = 0; i < num_betas; ++i) known.push_back(beta_names[i]);
  for (auto& [key, val] : args) {
    auto beta = std::find(beta_names.begin(), beta_names.begin() + static_cast<std::ptrdiff_t>(num_betas), key);
    if (beta != beta_names.begin() + static_cast<std::ptrdiff_t>(num_betas)) {  // b1= ... as an alternative to betas=(..)
      if (val.kind != ArgValue::Kind::Number) throw Error(name + ": " + key + " must be a number");
      r.v["betas"].pair.at(static_cast<size_t>(beta - beta_names.begin())) = val.number;
      continue;
    }
    auto it = r.v.find(key);
    if (it == r.v.end())
      throw Error(name + ": unknown argument '" + key + "'" + suggestion(key, known) +
                  (known.empty() ? " (it takes none)" : " (arguments: " + join_names(known, 1) + ")"));
    ArgValue v = val;
    if (it->second.kind == ArgValue::Kind::Number && v.kind == ArgValue::Kind::Bool)
      throw Error(name + ": " + key + " must be " + kind_name(ArgValue::Kind::Number) + ", got a boolean");
    const bool triple = it->second.kind == ArgValue::Kind::Pair && it->second.pair.size() == 3;
    if (v.kind != it->second.kind)
      throw Error(name + ": " + key + " must be " +
                  (triple ? std::string("three numbers like (0.9, 0.999, 0.9999)") : kind_name(it->second.kind)));
    if (v.kind == ArgValue::Kind::Pair && v.pair.size() != it->second.pair.size())
      throw Error(name + ": " + key + " must be " + (triple ? "three numbers" : "a pair of two numbers") + ", got " +
                  std::to_string(v.pair.size()));
    it->second = v;
  }
  for (auto& p : b.params)
    if (p.required && !args.count(p.name)) throw Error(name + ": missing required argument '" + p.name + "'");
  try {
    return b.make(r);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind(name + ":", 0) == 0) throw;
    // A rule named like the builtin ("rule scale: factor=...") needs its name only once.
    if (msg.rfind("rule " + name + ": ", 0) == 0) msg = msg.substr(5 + name.size() + 2);
    throw Error(name + ": " + msg);
  }
}

// Where an error of make_builtin(call.name, args) belongs: at the first argument that produces the
// same error on its own (an unknown name, a value of the wrong kind or out of range, an option that
// conflicts with the defaults), else at the call (a missing argument, a conflict between two).
static size_t argument_at_fault(const spec::Call& call, const Args& args, const std::string& message) {
  const Builtin& b = lookup(call.name);
  size_t positional = 0;
  for (const auto& a : call.args) {
    std::string key = a.keyword.empty() ? b.params.at(positional++).name : a.keyword;
    Args alone{{key, args.at(key)}};
    for (const Param& p : b.params)  // required arguments come along, so their absence is not blamed
      if (p.required && args.count(p.name)) alone[p.name] = args.at(p.name);
    try {
      make_builtin(call.name, alone);
    } catch (const Error& e) {
      if (message == e.what()) return a.pos;
    }
  }
  return call.pos;
}

// SPEC text: a call of a built-in name, or chain(...) of such calls.
static Chain chain_from_call(const std::string& text, const spec::Call& call) {
  auto where = [&](size_t pos) { return "\n" + spec::format_position(text, pos); };
  if (call.name == "chain") {
    Chain out;
    for (const auto& a : call.args) {
      if (!a.keyword.empty() || a.value.kind != spec::Value::Kind::Call)
        throw Error("spec: chain(...) takes rules, like chain(clip_by_global_norm(1.0), adamw())" + where(a.pos));
      Chain part = chain_from_call(text, *a.value.call);
      out.insert(out.end(), part.begin(), part.end());
    }
    if (out.empty()) throw Error("spec: chain() needs at least one rule" + where(call.pos));
    return out;
  }
  std::vector<std::string> order;
  try {
    order = builtin_parameter_names(call.name);
  } catch (const Error& e) {
    throw Error(std::string("spec: ") + e.what() + where(call.pos));
  }
  Args args;
  size_t positional = 0;
  for (const auto& a : call.args) {
    std::string key = a.keyword;
    if (key.empty()) {
      if (positional >= order.size())
        throw Error("spec: " + call.name +
                    (order.empty() ? std::string(" takes no arguments")
                                   : " takes at most " + std::to_string(order.size()) + " positional argument" +
                                         (order.size() == 1 ? "" : "s")) +
                    where(a.pos));
      key = order[positional++];
    }
    const spec::Value& v = a.value;
    switch (v.kind) {
      case spec::Value::Kind::Number: args[key] = ArgValue(v.number); break;
      case spec::Value::Kind::Bool: args[key] = ArgValue(v.boolean); break;
      case spec::Value::Kind::Tuple: {
        std::vector<double> xs;
        for (const auto& item : v.items) {
          if (item.kind != spec::Value::Kind::Number)
            throw Error("spec: " + key + " must be a tuple of numbers" + where(item.pos));
          xs.push_back(item.number);
        }
        args[key] = ArgValue(xs);
        break;
      }
      default:
        throw Error("spec: " + call.name + ": " + key + " must be a number, true/false or a tuple" + where(v.pos));
    }
  }
  try {
    return make_builtin(call.name, args);
  } catch (const Error& e) {
    throw Error(std::string("spec: ") + e.what() + where(argument_at_fault(call, args, e.what())));
  }
}

Chain parse_chain(const std::string& text) { return chain_from_call(text, spec::parse(text)); }

}  // namespace optfuse
