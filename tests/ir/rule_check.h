// A harness that checks a chain, run by a backend, against math written out by hand in the test.
//
// Each case gives the per-element formula of one step in plain double arithmetic, as published
// (torch.optim docs, optax, the Lion paper), never by calling the library's evaluator. The harness
// steps a set of tensors (sizes 0, 1, 3, 5, 1023, 65537 in two parameter groups) with new random
// gradients every step and, before each step, reads back what the backend stored, computes the
// expected new values from those inputs with the hand formula, rounds them to the storage type and
// compares. Checking every step from the stored inputs (instead of running the formula freely for
// all steps) keeps the check exact for 16-bit storage, where each stored value is rounded, and
// keeps float32 differences from compounding; the step count, bias corrections and state still
// evolve over the whole trajectory, so a wrong step number or a lost state shows up.
//
// Tolerance, per element, for a value whose old stored value is `old` and expected new value `x`:
//   kRel32 * (|old| + |x - old| + S)      float32 math vs double: about 8 float32 ulps of the
//                                         magnitudes involved, where S = sum over the inputs (param,
//                                         grad, states) of |input * d x / d input|, measured by
//                                         perturbing each input: a float32 rounding inside the
//                                         formula acts like such a perturbation, so cancellation
//                                         (g + wd*p close to 0) gets the error it really has
//   + one storage ulp of x                for bfloat16 / float16 storage only: float32 and double
//                                         results may sit on either side of a rounding midpoint
//   + the case's own slack                only where the formula is ill-conditioned (Lion's sign of
//                                         a value within rounding of zero)
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"

namespace optfuse::rulecheck {

constexpr double kRel32 = 1e-6;
constexpr double kProbe = 1e-7;  // relative input perturbation that measures sensitivity

// One float32 element (parameter 1, states at their init values) on the reference backend, stepped
// by hand with chosen gradients: the harness of the hand-derived rule tests. Holds pointers into
// itself, so it does not move.
class OneElement {
 public:
  explicit OneElement(const Chain& chain) : opt_(chain, Backend::reference, 1), s_(opt_.plan().program.states.size()) {
    TensorRef r;
    r.param = Buffer{&p_, 1, DType::f32};
    r.grad = Buffer{&g_, 1, DType::f32};
    for (float& x : s_) r.states.push_back(Buffer{&x, 1, DType::f32});
    init_host_states(opt_.plan(), r);
    opt_.set_tensors({r});
  }
  OneElement(const OneElement&) = delete;
  OneElement& operator=(const OneElement&) = delete;

  Optimizer& optimizer() { return opt_; }
  void step(float grad) {
    g_ = grad;
    opt_.step();
  }
  double param() const { return p_; }
  // A state by its qualified name ("scale_by_ademamix.exp_avg_fast").
  double state(const std::string& qualified) const {
    const auto& states = opt_.plan().program.states;
    for (size_t i = 0; i < states.size(); ++i)
      if (states[i].qualified == qualified) return s_[i];
    ADD_FAILURE() << "no state " << qualified;
    return 0.0;
  }

 private:
  float p_ = 1.0f, g_ = 0.0f;
  Optimizer opt_;
  std::vector<float> s_;
};

struct StepCtx {
  int group = 0;       // the element's parameter group
  int t = 1;           // step being taken in that group: 1 on the first
  double global = 0;   // a whole-step value the case computed from all gradients (clip coefficient)
};

// One element, one step: reads the old parameter p, the gradient g as stored and the old states s
// (in the plan's order), writes the new p and s in place. Returns extra absolute error allowed for
// p (0 except where the formula itself is ill-conditioned).
using ElementMath = std::function<double(const StepCtx&, double g, double& p, double* s)>;
using Grads = std::vector<std::vector<double>>;  // [tensor][element], as stored

struct RuleCase {
  std::string name;
  Chain chain;
  std::vector<std::string> states;           // expected qualified state names, plan order
  std::function<void(Optimizer&)> configure;  // sets group 1 apart (different lr, weight_decay...)
  ElementMath math;
  std::function<double(const Grads&)> global;  // optional whole-step value
  // Step inputs (passed only when used): gradients are stored multiplied by grad_scale;
  // found_inf = 1 at step `found_inf_step`; one gradient element is NaN at `nonfinite_step`.
  float grad_scale = 1.0f;
  int found_inf_step = 0;
  int nonfinite_step = 0;
  bool skips_nonfinite = false;  // the chain skips a step whose gradients are not all finite
  int steps = 5;
};

// Value rounded to the storage type, written independently of the library's converters: round to
// nearest even at 8 (bfloat16) or 11 (float16, with subnormals below 2^-14) significant bits.
inline double round_to_storage(double x, DType t) {
  if (t == DType::f32) return static_cast<double>(static_cast<float>(x));
  if (x == 0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  int bits = t == DType::bf16 ? 8 : 11;
  int q = e - bits;                     // exponent of one unit in the last place
  if (t == DType::f16 && q < -24) q = -24;
  return std::ldexp(std::nearbyint(std::ldexp(x, -q)), q);
}

inline double storage_ulp(double x, DType t) {
  if (t == DType::f32) return 0;
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-300), &e);
  int q = e - (t == DType::bf16 ? 8 : 11);
  if (t == DType::f16 && q < -24) q = -24;
  return std::ldexp(1.0, q);
}

struct TensorPlace {
  int64_t numel;
  int group;
};
// Many tensors of awkward sizes, in both groups, with empty ones in between.
inline const std::vector<TensorPlace>& standard_tensors() {
  static const std::vector<TensorPlace> t = {{65537, 0}, {0, 0}, {1, 1}, {3, 0}, {1023, 1}, {0, 1}, {5, 1}};
  return t;
}

// Runs `c` on `backend` with `dtype` storage; reports every mismatch through gtest (at most a few
// lines per role). Returns the worst error / tolerance ratio seen (for tuning; must be <= 1).
inline double run_case(const RuleCase& c, Backend backend, DType dtype) {
  SCOPED_TRACE(c.name + " on " + backend_name(backend) + ", " + dtype_name(dtype));
  Optimizer opt(c.chain, backend, 2);
  const Program& prog = opt.plan().program;
  std::vector<std::string> names;
  for (const auto& s : prog.states) names.push_back(s.qualified);
  EXPECT_EQ(names, c.states) << "state slots of " << prog.chain_text;
  if (c.configure) c.configure(opt);
  const size_t ns = prog.states.size(), roles = 2 + ns;
  const auto& places = standard_tensors();
  const size_t bytes = dtype_size(dtype);

  std::vector<std::vector<std::vector<uint8_t>>> mem(places.size());
  std::vector<TensorRef> refs;
  std::mt19937_64 rng(1234);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t t = 0; t < places.size(); ++t) {
    mem[t].assign(roles, std::vector<uint8_t>(static_cast<size_t>(places[t].numel) * bytes + 1));
    TensorRef r;
    r.group = places[t].group;
    auto buf = [&](size_t role) { return Buffer{mem[t][role].data(), places[t].numel, dtype}; };
    r.param = buf(0);
    r.grad = buf(1);
    for (int64_t i = 0; i < places[t].numel; ++i) store_element(r.param.data, dtype, i, normal(rng));
    for (size_t s = 0; s < ns; ++s) r.states.push_back(buf(2 + s));
    init_host_states(opt.plan(), r);  // init values; a copy of the parameter for a from-param state
    refs.push_back(r);
  }
  opt.set_tensors(refs);

  int64_t taken[2] = {opt.step_count(0), opt.step_count(1)};  // configure may resume a group
  double worst = 0;
  for (int step = 1; step <= c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Grads grads(places.size());
    bool nonfinite = false;
    for (size_t t = 0; t < places.size(); ++t) {
      for (int64_t i = 0; i < places[t].numel; ++i)
        store_element(refs[t].grad.data, dtype, i, normal(rng) * c.grad_scale);
      if (step == c.nonfinite_step && places[t].numel > 2) {  // one NaN in the first big tensor
        store_element(refs[t].grad.data, dtype, 1, NAN);
        nonfinite = true;
      }
      for (int64_t i = 0; i < places[t].numel; ++i) grads[t].push_back(load_element(refs[t].grad.data, dtype, i));
    }
    bool skip = step == c.found_inf_step || (nonfinite && c.skips_nonfinite);
    StepCtx ctx;
    ctx.global = c.global ? c.global(grads) : 0.0;

    // Expected values, from the stored inputs.
    std::vector<std::vector<std::vector<double>>> old(places.size()), want(places.size());
    std::vector<std::vector<double>> slack(places.size());
    std::vector<std::vector<std::vector<double>>> sens(places.size());
    for (size_t t = 0; t < places.size(); ++t) {
      int64_t n = places[t].numel;
      old[t].assign(roles, std::vector<double>(static_cast<size_t>(n)));
      for (size_t r = 0; r < roles; ++r)
        if (r != 1)
          for (int64_t i = 0; i < n; ++i) old[t][r][static_cast<size_t>(i)] = load_element(mem[t][r].data(), dtype, i);
      want[t] = old[t];
      slack[t].assign(static_cast<size_t>(n), 0.0);
      if (skip) continue;
      ctx.group = places[t].group;
      ctx.t = static_cast<int>(taken[ctx.group]) + 1;
      sens[t].assign(roles, std::vector<double>(static_cast<size_t>(n), 0.0));
      // in[0] param, in[1] grad, in[2+k] state k; out the same without the gradient.
      std::vector<double> in(roles), out(roles), pert(roles), moved(roles);
      auto eval = [&](std::vector<double>& v, std::vector<double>& res) {
        res = v;
        return c.math(ctx, v[1], res[0], res.data() + 2);
      };
      for (int64_t i = 0; i < n; ++i) {
        size_t e = static_cast<size_t>(i);
        for (size_t r = 0; r < roles; ++r) in[r] = r == 1 ? grads[t][e] : old[t][r][e];
        slack[t][e] = eval(in, out);
        for (size_t r = 0; r < roles; ++r) want[t][r][e] = r == 1 ? 0.0 : round_to_storage(out[r], dtype);
        // Sensitivity to each input: float32 rounding inside the formula acts like a relative
        // perturbation of the values it combines, so cancellation (g + wd p near 0) is allowed for.
        for (size_t j = 0; j < roles; ++j) {
          if (in[j] == 0 || !std::isfinite(in[j])) continue;
          moved = in;
          moved[j] *= 1 + kProbe;
          eval(moved, pert);
          for (size_t r = 0; r < roles; ++r) sens[t][r][e] += std::fabs(pert[r] - out[r]) / kProbe;
        }
      }
    }

    StepInputs in;
    float scale = c.grad_scale, found = step == c.found_inf_step ? 1.0f : 0.0f;
    if (c.grad_scale != 1.0f || c.found_inf_step) {
      in.grad_scale = &scale;
      in.found_inf = &found;
    }
    opt.step(in);

    for (size_t t = 0; t < places.size(); ++t) {
      for (size_t r = 0; r < roles; ++r) {
        if (r == 1) continue;
        int reported = 0;
        for (int64_t i = 0; i < places[t].numel; ++i) {
          size_t e = static_cast<size_t>(i);
          double got = load_element(mem[t][r].data(), dtype, i), x = want[t][r][e], o = old[t][r][e];
          double tol = kRel32 * (std::fabs(o) + std::fabs(x - o) + (skip ? 0.0 : sens[t][r][e])) +
                       (r == 0 ? slack[t][e] : 0.0) +
                       storage_ulp(std::max(std::fabs(x), std::fabs(got)), dtype) + 1e-30;
          double err = std::fabs(got - x);
          bool ok = err <= tol;  // false for NaN
          if (ok) {
            worst = std::max(worst, err / tol);
            continue;
          }
          worst = std::max(worst, std::isnan(err) ? 1e300 : err / tol);
          if (reported++ < 3)
            ADD_FAILURE() << "tensor " << t << " (" << places[t].numel << " elements, group " << places[t].group
                          << ") " << (r == 0 ? std::string("param") : names[r - 2]) << "[" << i
                          << "]: got " << got << ", expected " << x << " (old " << o << ", grad "
                          << grads[t][e] << ", error " << err << " > tolerance " << tol << ")";
        }
        if (reported > 3) ADD_FAILURE() << "  ... " << reported - 3 << " more mismatches in this tensor";
      }
    }
    for (int g = 0; g < 2; ++g) {
      if (!skip) ++taken[g];
      EXPECT_EQ(opt.step_count(g), taken[g]) << "group " << g;
    }
    if (::testing::Test::HasFailure()) break;  // one failing step says enough
  }
  return worst;
}

// Every case runs on both host backends and all three storage types.
inline void run_everywhere(const RuleCase& c) {
  for (Backend b : {Backend::reference, Backend::cpu})
    for (DType d : {DType::f32, DType::bf16, DType::f16}) {
      double worst = run_case(c, b, d);
      if (std::getenv("OPTFUSE_TEST_VERBOSE"))
        std::printf("  %-40s %-9s %-8s worst error/tolerance %.3g\n", c.name.c_str(), backend_name(b),
                    dtype_name(d), worst);
      if (::testing::Test::HasFailure()) return;
    }
}

inline double sq(double x) { return x * x; }
inline double sgn(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }

// Global L2 norm of all gradients of the step (every tensor of every group), as
// torch.nn.utils.clip_grad_norm_ computes it, and its clip coefficient min(max_norm/(norm+1e-6), 1).
inline double clip_coefficient(const Grads& g, double max_norm, double divide_by = 1.0) {
  double ss = 0;
  for (const auto& t : g)
    for (double x : t) ss += sq(x / divide_by);
  return std::min(max_norm / (std::sqrt(ss) + 1e-6), 1.0);
}

}  // namespace optfuse::rulecheck
