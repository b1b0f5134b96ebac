// A user-written rule chained with built-ins: AdaBelief (Zhuang et al., NeurIPS 2020), which is
// Adam with the second moment of the gradient replaced by the "belief" s, the variance of the
// gradient around its running mean:
//   m = b1 m + (1-b1) g
//   s = b2 s + (1-b2) (g - m)^2 + eps
//   update = (m / (1-b1^t)) / (sqrt(s / (1-b2^t)) + eps)
// chained with global-norm clipping, decoupled weight decay and the learning rate, all built-in.
// The program prints what optfuse makes of the chain (passes, IR, plan, generated C++), runs it on
// the CPU backend and checks it against the reference evaluator and against the formula above.
// Exit status 0 when everything agrees.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <vector>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"

using namespace optfuse;

// The whole rule: declarations, then the math. Hyperparameters are per parameter group and can be
// changed between steps (Optimizer::set_hyper) without recompiling.
Rule scale_by_belief(double b1 = 0.9, double b2 = 0.999, double eps = 1e-16) {
  return Rule("scale_by_belief")
      .hyper("b1", b1, Range::unit_interval_open_right())
      .hyper("b2", b2, Range::unit_interval_open_right())
      .hyper("eps", eps, Range::non_negative())
      .state("exp_avg")
      .state("exp_avg_var")
      .update([](RuleBuilder& b) {
        Expr g = b.update(), t = b.step(), b1 = b.hyper("b1"), b2 = b.hyper("b2"), eps = b.hyper("eps");
        Expr m = b.name(b1 * b.state("exp_avg") + (1.0 - b1) * g, "exp_avg_new");
        Expr d = b.name(g - m, "surprise");
        Expr s = b.name(b2 * b.state("exp_avg_var") + (1.0 - b2) * d * d + eps, "exp_avg_var_new");
        b.set_state("exp_avg", m);
        b.set_state("exp_avg_var", s);
        Expr m_hat = m / (1.0 - pow(b1, t));
        Expr s_hat = b.name(s / (1.0 - pow(b2, t)), "belief_hat");
        return m_hat / (sqrt(s_hat) + eps);
      });
}

int main() {
  const double lr = 1e-2, wd = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-16, max_norm = 1.0;
  Chain c = chain({clip_by_global_norm(max_norm), {scale_by_belief(b1, b2, eps)},
                   make_builtin("add_decayed_weights", {{"weight_decay", wd}}),
                   make_builtin("scale_by_learning_rate", {{"lr", lr}})});

  // What `optfuse explain` prints for a SPEC, for this C++ chain.
  Optimizer cpu(c, Backend::cpu), ref(c, Backend::reference);
  const Plan& plan = cpu.plan();
  std::cout << "== chain\n" << plan.program.chain_text << "\n\n== passes\n";
  for (const auto& line : plan.pass_log) std::cout << "  " << line << "\n";
  std::cout << "\n== IR after passes\n" << print_ir(plan.program, &plan.kind) << "\n== plan\n" << plan.describe();
  std::cout << "\n== generated cpu source\n" << cpu.source() << "\n== backend\n" << cpu.backend_status() << "\n\n";

  // Two tensors, float32, states at their init values; the same inputs for both backends.
  const int n0 = 1000, n1 = 3;
  auto setup = [&](Optimizer& opt, std::vector<std::vector<float>>& p, std::vector<std::vector<float>>& g,
                   std::vector<std::vector<float>>& states) {
    std::vector<TensorRef> refs;
    states.assign(4, {});
    for (int t = 0; t < 2; ++t) {
      int n = t ? n1 : n0;
      p[t].resize(n), g[t].resize(n);
      for (int i = 0; i < n; ++i) p[t][i] = std::sin(0.1f * static_cast<float>(i + 7 * t));
      states[2 * t].assign(n, 0.0f), states[2 * t + 1].assign(n, 0.0f);
      refs.push_back({{p[t].data(), n, DType::f32}, {g[t].data(), n, DType::f32},
                      {{states[2 * t].data(), n, DType::f32}, {states[2 * t + 1].data(), n, DType::f32}}, 0});
    }
    opt.set_tensors(refs);
  };
  std::vector<std::vector<float>> cp(2), cg(2), cs, rp(2), rg(2), rs;
  setup(cpu, cp, cg, cs);
  setup(ref, rp, rg, rs);

  // The formula, in double, for element 5 of tensor 0.
  double p = cp[0][5], m = 0, s = 0;
  double worst = 0;
  for (int step = 1; step <= 3; ++step) {
    double sumsq = 0;
    for (int t = 0; t < 2; ++t)
      for (size_t i = 0; i < cg[t].size(); ++i) {
        float gv = std::cos(0.37f * static_cast<float>(i) + static_cast<float>(step) + static_cast<float>(t));
        cg[t][i] = rg[t][i] = gv;
        sumsq += static_cast<double>(gv) * gv;
      }
    double coef = std::min(max_norm / (std::sqrt(sumsq) + 1e-6), 1.0), g = cg[0][5] * coef;
    m = b1 * m + (1 - b1) * g;
    s = b2 * s + (1 - b2) * (g - m) * (g - m) + eps;
    double upd = (m / (1 - std::pow(b1, step))) / (std::sqrt(s / (1 - std::pow(b2, step))) + eps);
    p = p - lr * (upd + wd * p);

    cpu.step();
    ref.step();
    for (int t = 0; t < 2; ++t)
      for (size_t i = 0; i < cp[t].size(); ++i) worst = std::max(worst, std::fabs(double(cp[t][i]) - rp[t][i]));
    std::printf("step %d: param[0][5] cpu %.9g reference %.9g formula %.9g\n", step, cp[0][5], rp[0][5], p);
  }
  bool ok = worst <= 1e-6 && std::fabs(cp[0][5] - p) <= 1e-6 && std::fabs(rp[0][5] - p) <= 1e-6;
  std::printf("%s: largest cpu-reference difference %.3g over 3 steps\n", ok ? "OK" : "MISMATCH", worst);
  return ok ? 0 : 1;
}
