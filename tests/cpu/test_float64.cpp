// float64 tensors (DType::f64, issue 32): a tensor with a float64 role does its element math in
// float64 (as torch computes in a float64 parameter's dtype), so the CPU backend matches the
// float64 reference evaluator to ~1e-12 of each role's scale (only the order of a reduction's sums
// differs), not to float32's 1e-5:
//   - every built-in rule but Muon's Newton-Schulz (a matrix phase, float32/16-bit only) on the CPU
//     backend against the reference, every scope: global, per tensor (LAMB, LARS), per row and column
//     (Adafactor, on matrices and batches of matrices), uniform states (NAdam, ASGD);
//   - hand-computed float64 values (SGD, AdamW, clip_by_global_norm) that float32 math cannot give;
//   - float32, float64 and bfloat16 tensors in one optimizer (one tensor table, a variant each): each
//     within its own dtype's tolerance, the float64 tensors bitwise as when stepped alone;
//   - the CPU backend's interpreter (no compiler) runs float64 tensors in float64 too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "codegen/cpu_source.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "testing/precision_cases.h"
#include "testing/scoped_env.h"
#include "testing/tensor_set.h"

namespace optfuse {
namespace {

using testing::HostTensorSet;
using testing::TensorSpec;

constexpr double kF64Tolerance = 1e-12;  // relative to each role's scale
const std::vector<TensorSpec> kSizes = {{0, 0}, {1, 0}, {3, 1}, {1023, 0}, {65537, 1}};
// Matrices (cols) and a batch of matrices (matrix_rows) for the row/column rules, with vectors.
const std::vector<TensorSpec> kMatrices = {{64 * 48, 0, 48}, {5, 1}, {3 * 20 * 33, 1, 33, 20}, {700 * 130, 0, 130}, {1, 0, 1}};

// max |a - b| / scale over every role but the gradient, scale = max |b| of the role over all tensors;
// NaN where exactly one of a, b is NaN.
double max_scaled_difference(const HostTensorSet& a, const HostTensorSet& b) {
  double worst = 0;
  for (size_t r = 0; r < b.num_roles(); ++r) {
    if (r == 1) continue;
    double scale = 1e-300, diff = 0;
    for (size_t t = 0; t < b.size(); ++t)
      for (int64_t i = 0; i < b.numel(t, r); ++i) {
        double x = a.value(t, r, i), y = b.value(t, r, i);
        if (std::isnan(x) != std::isnan(y)) return NAN;
        if (std::isnan(x)) continue;
        scale = std::max(scale, std::fabs(y));
        diff = std::max(diff, std::fabs(x - y));
      }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

bool same_bytes(HostTensorSet& a, HostTensorSet& b) {
  for (size_t t = 0; t < b.size(); ++t)
    for (size_t r = 0; r < b.num_roles(); ++r)
      if (a.bytes(t, r) != b.bytes(t, r)) return false;
  return true;
}

void configure(Optimizer& o) {
  try {
    o.set_hyper(1, "lr", 0.5 * o.hyper(0, "lr"));
  } catch (const Error&) {
  }
}

struct F64Case {
  const char* spec;
  bool matrices = false;  // step kMatrices (row/column rules) instead of kSizes
  int nan_step = 0;       // one gradient element is NaN at this step
};

// Every built-in rule (alone or in its named optimizer) but newton_schulz / muon.
const std::vector<F64Case>& cases() {
  static const std::vector<F64Case> c = {
      {"chain(scale_by_adam(b1=0.8, b2=0.95, eps=1e-3, amsgrad=true), scale_by_learning_rate(0.1))"},
      {"chain(add_decayed_weights(0.1), scale(-0.5), scale_by_learning_rate(0.1))"},
      {"chain(decoupled_weight_decay(lr=0.1, weight_decay=0.1), sgd(lr=0.1))"},
      {"chain(trace(momentum=0.9, dampening=0.2, nesterov=false), scale_by_learning_rate(0.1))"},
      {"chain(scale_by_lion(), scale_by_learning_rate(0.1))"},
      {"chain(scale_by_rms(alpha=0.9, eps=1e-3, centered=true), scale_by_learning_rate(0.1))"},
      {"chain(scale_by_adagrad(lr_decay=0.1, initial_accumulator_value=0.1), scale_by_learning_rate(0.1))"},
      {"chain(clip_by_global_norm(10.0), sgd(lr=0.1, momentum=0.9))"},
      {"chain(clip_by_global_norm_ratio(10.0), sgd(lr=0.1))"},
      {"chain(unscale_by_grad_scale(), skip_if_nonfinite(), adam(lr=0.1))", false, 5},
      {"sgd(lr=0.1, momentum=0.9, nesterov=true, weight_decay=0.1, maximize=true)"},
      {"adam(lr=0.1, betas=(0.8, 0.9), amsgrad=true, weight_decay=0.1)"},
      {"adamw(lr=0.1, weight_decay=0.3)"},
      {"lion(lr=0.1, weight_decay=0.5)"},
      {"rmsprop(lr=0.01, weight_decay=0.1, momentum=0.5, centered=true)"},
      {"adagrad(lr=0.1, lr_decay=0.3, weight_decay=0.1, initial_accumulator_value=0.5)"},
      // Per-tensor reductions (trust ratios).
      {"chain(scale_by_lamb(), scale_by_learning_rate(0.1))"},
      {"lamb(lr=0.1, weight_decay=0.1, decoupled_decay=true, trust_clip=true)"},
      {"chain(scale_by_lars(), scale_by_learning_rate(0.1))"},
      {"lars(lr=0.5, weight_decay=0.01, momentum=0.9, nesterov=true, trust_clip=true)"},
      {"chain(scale_by_radam(), scale_by_learning_rate(0.1))"},
      {"radam(lr=0.1, weight_decay=0.1, decoupled_weight_decay=true)"},
      {"chain(scale_by_adamax(), scale_by_learning_rate(0.1))"},
      {"adamax(lr=0.1, weight_decay=0.1)"},
      {"chain(scale_by_adadelta(), scale_by_learning_rate(0.1))"},
      {"adadelta(lr=1.0, weight_decay=0.1)"},
      {"chain(scale_by_rprop(lr=0.1), scale(-1.0))"},
      {"rprop(lr=0.05)"},
      {"averaged_sgd(lr=0.1)"},
      {"asgd(lr=0.1, weight_decay=0.1)"},
      {"chain(scale_by_nadam(lr=0.1), scale_by_learning_rate(1.0))"},
      {"nadam(lr=0.1, weight_decay=0.1, decoupled_weight_decay=true)"},
      {"chain(scale_by_ademamix(), scale_by_learning_rate(0.01))"},
      {"ademamix(lr=0.01, betas=(0.8, 0.9, 0.99), alpha=5.0, t_alpha=3, t_beta3=5, weight_decay=0.1)"},
      {"chain(scale_by_muon_momentum(), scale_by_muon_lr(lr=0.1))"},
      {"schedule_free_adamw(lr=0.01, warmup_steps=3)"},
      {"adamw_schedule_free(lr=0.01, weight_decay=0.1)"},
      // Row and column values (Adafactor), on matrices and a batch of matrices.
      {"chain(scale_by_adafactor(lr=0.01), scale(-1.0))", true},
      {"adafactor(lr=0.01, weight_decay=0.1)", true},
  };
  return c;
}

// Ten steps of `c` on `set` (new gradients each step; a NaN at c.nan_step).
void run_steps(Optimizer& opt, HostTensorSet& set, const F64Case& c, int steps = 10) {
  for (int s = 1; s <= steps; ++s) {
    set.randomize_grads(1000 + static_cast<uint64_t>(s));
    if (s == c.nan_step) store_element(set.bytes(set.size() - 1, 1).data(), set.dtype(1), 17, NAN);
    opt.step();
  }
}

TEST(Float64, EveryBuiltinRuleIsCovered) {
  std::string all;
  for (const F64Case& c : cases()) all += std::string(c.spec) + " ";
  for (const std::string& name : builtin_names()) {
    if (name == "newton_schulz" || name == "muon") continue;  // the matrix phase: float32 and 16-bit only
    EXPECT_NE(all.find(name + "("), std::string::npos) << name << " has no float64 case";
  }
}

class Float64VsReference : public ::testing::TestWithParam<size_t> {};

TEST_P(Float64VsReference, CpuMatchesTheReference) {
  const F64Case& c = cases()[GetParam()];
  SCOPED_TRACE(c.spec);
  Chain chain = parse_chain(c.spec);
  Optimizer ref(chain, Backend::reference, 2), cpu(chain, Backend::cpu, 2);
  ASSERT_NE(cpu.backend_status().find("compiled"), std::string::npos) << cpu.backend_status();
  configure(ref);
  configure(cpu);
  const std::vector<TensorSpec>& specs = c.matrices ? kMatrices : kSizes;
  HostTensorSet rs(ref.plan(), specs, DType::f64, 7), cs(cpu.plan(), specs, DType::f64, 7);
  const HostTensorSet fresh = rs;
  ref.set_tensors(rs.refs());
  cpu.set_tensors(cs.refs());
  for (int s = 1; s <= 10; ++s) {
    rs.randomize_grads(1000 + static_cast<uint64_t>(s));
    cs.randomize_grads(1000 + static_cast<uint64_t>(s));
    if (s == c.nan_step) {
      store_element(rs.bytes(4, 1).data(), DType::f64, 17, NAN);
      store_element(cs.bytes(4, 1).data(), DType::f64, 17, NAN);
    }
    ref.step();
    cpu.step();
    const double diff = max_scaled_difference(cs, rs);
    ASSERT_LE(diff, kF64Tolerance) << "step " << s;  // false for NaN too
    ASSERT_EQ(cpu.step_count(0), ref.step_count(0));
  }
  // The parameters moved, by far more than the tolerance (a backend that did nothing would match
  // a reference that did nothing).
  EXPECT_GT(max_scaled_difference(fresh, rs), 1e-4);
}

std::string case_name(const ::testing::TestParamInfo<size_t>& info) {
  std::string spec = cases()[info.param].spec;
  if (spec.rfind("chain(", 0) == 0) spec = spec.substr(6);
  std::string name = std::to_string(info.param) + "_";
  for (char ch : spec.substr(0, spec.find('('))) name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return name;
}
INSTANTIATE_TEST_SUITE_P(Chains, Float64VsReference, ::testing::Range<size_t>(0, cases().size()), case_name);

// ---- hand-computed float64 values --------------------------------------------------------------

// One tensor of n float64 elements per role, stepped on `b` from p and g.
struct Tensor64 {
  std::vector<double> p, g;
  std::vector<std::vector<double>> states;
  Tensor64(std::vector<double> p0, std::vector<double> g0, const Plan& plan) : p(std::move(p0)), g(std::move(g0)) {
    for (const ProgramState& s : plan.program.states) states.emplace_back(p.size(), s.init);
  }
  TensorRef ref() {
    TensorRef t;
    const int64_t n = static_cast<int64_t>(p.size());
    t.param = {p.data(), n, DType::f64};
    t.grad = {g.data(), n, DType::f64};
    for (auto& s : states) t.states.push_back({s.data(), n, DType::f64});
    return t;
  }
};

TEST(Float64, SgdKeepsDigitsFloat32CannotHold) {
  // p = 1 + 2^-40: float32 rounds it to 1. lr * g = 3e-13 is below float32's resolution at 1 too.
  for (Backend b : {Backend::reference, Backend::cpu}) {
    Optimizer opt(parse_chain("sgd(lr=1e-12)"), b);
    const double p0 = 1.0 + std::ldexp(1.0, -40);
    Tensor64 t({p0, -2.5, 1e-300}, {0.3, 7.0, 1e-290}, opt.plan());
    opt.set_tensors({t.ref()});
    opt.step();
    EXPECT_EQ(t.p[0], p0 - 1e-12 * 0.3) << backend_name(b);  // the same one rounding: bit for bit
    EXPECT_EQ(t.p[1], -2.5 - 1e-12 * 7.0) << backend_name(b);
    EXPECT_EQ(t.p[2], 1e-300 - 1e-12 * 1e-290) << backend_name(b);  // far below float32's range
    EXPECT_NE(t.p[0], 1.0);
  }
}

TEST(Float64, AdamWMatchesHandComputedDoubles) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  for (Backend b : {Backend::reference, Backend::cpu}) {
    Optimizer opt(parse_chain("adamw(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)"), b);
    std::vector<double> p = {0.1234567890123456, -3.0000000001, 1.0 + 1e-11};
    std::vector<double> g1 = {0.5, -1e-7, 3.0000000000003}, g2 = {-0.25, 2e-7, 3.0};
    Tensor64 t(p, g1, opt.plan());
    opt.set_tensors({t.ref()});
    std::vector<double> m(3, 0.0), v(3, 0.0), want = p;
    for (int step = 1; step <= 2; ++step) {
      const std::vector<double>& g = step == 1 ? g1 : g2;
      t.g = g;
      opt.set_tensors({t.ref()});
      opt.step();
      for (size_t i = 0; i < 3; ++i) {  // torch.optim.AdamW, in double
        want[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
        want[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
      }
    }
    for (size_t i = 0; i < 3; ++i) {
      SCOPED_TRACE(std::string(backend_name(b)) + " element " + std::to_string(i));
      EXPECT_NEAR(t.p[i], want[i], 1e-15 * std::fabs(want[i]));
      EXPECT_NEAR(t.states[0][i], m[i], 1e-15 * std::fabs(m[i]));
      EXPECT_NEAR(t.states[1][i], v[i], 1e-15 * std::fabs(v[i]));
    }
    // Element 2 moved by about lr * (1 - 1e-11 ...): its 1e-11 offset survives (float32 would round it away).
    EXPECT_GT(std::fabs(t.p[2] - (1.0 - lr * wd * 2 - 2 * lr)), 1e-12);
  }
}

TEST(Float64, ClipByGlobalNormMatchesHandComputedDoubles) {
  // A global norm over two tensors in two groups, then per-tensor trust ratios (LAMB-like) by hand:
  // clip_by_global_norm then sgd.
  for (Backend b : {Backend::reference, Backend::cpu}) {
    Optimizer opt(parse_chain("chain(clip_by_global_norm(1.0), sgd(lr=0.1))"), b, 2);
    std::vector<double> pa(3000), ga(3000), pb(17), gb(17);
    for (size_t i = 0; i < pa.size(); ++i) pa[i] = 1.0 + i * 1e-13, ga[i] = std::sin(0.37 * i) * 1e-3 + 1e-9;
    for (size_t i = 0; i < pb.size(); ++i) pb[i] = -2.0 + i * 1e-14, gb[i] = std::cos(1.3 * i) * 0.5;
    Tensor64 ta(pa, ga, opt.plan()), tb(pb, gb, opt.plan());
    TensorRef rb = tb.ref();
    rb.group = 1;
    opt.set_tensors({ta.ref(), rb});
    opt.step();
    double sum = 0;
    for (double x : ga) sum += x * x;
    for (double x : gb) sum += x * x;
    const double coef = std::min(1.0 / (std::sqrt(sum) + 1e-6), 1.0);
    ASSERT_LT(coef, 0.99);  // the clip is active
    double worst = 0;
    for (size_t i = 0; i < pa.size(); ++i) worst = std::max(worst, std::fabs(ta.p[i] - (pa[i] - 0.1 * (ga[i] * coef))));
    for (size_t i = 0; i < pb.size(); ++i) worst = std::max(worst, std::fabs(tb.p[i] - (pb[i] - 0.1 * (gb[i] * coef))));
    EXPECT_LE(worst, 1e-15) << backend_name(b);  // (float32 math: ~1e-7)
  }
}

TEST(Float64, LambTrustRatioPerTensorMatchesHandComputedDoubles) {
  // scale_by_lamb's update on step 1 (bias-corrected Adam: g / (|g| + eps)) times the per-tensor
  // trust ratio ||p|| / ||update|| (LAMB, no weight decay, always_adapt), two tensors of different norms.
  for (Backend b : {Backend::reference, Backend::cpu}) {
    Optimizer opt(parse_chain("lamb(lr=0.01, eps=1e-6, weight_decay=0.0, max_grad_norm=0, always_adapt=true)"), b);
    std::vector<double> pa(1000), ga(1000), pb(33), gb(33);
    for (size_t i = 0; i < pa.size(); ++i) pa[i] = 0.5 + std::sin(0.1 * i), ga[i] = std::cos(0.7 * i) + 0.1;
    for (size_t i = 0; i < pb.size(); ++i) pb[i] = 1e-3 * (i + 1), gb[i] = (i % 3) - 1.0 + 1e-3;
    Tensor64 ta(pa, ga, opt.plan()), tb(pb, gb, opt.plan());
    opt.set_tensors({ta.ref(), tb.ref()});
    opt.step();
    for (int k = 0; k < 2; ++k) {
      const std::vector<double>& p = k ? pb : pa;
      const std::vector<double>& g = k ? gb : ga;
      const std::vector<double>& got = k ? tb.p : ta.p;
      std::vector<double> u(p.size());
      double pn = 0, un = 0;
      for (size_t i = 0; i < p.size(); ++i) {
        const double m = 0.1 * g[i] / (1 - 0.9), v = 0.001 * g[i] * g[i] / (1 - 0.999);
        u[i] = m / (std::sqrt(v) + 1e-6);
        pn += p[i] * p[i];
        un += u[i] * u[i];
      }
      const double trust = std::sqrt(pn) / std::sqrt(un);
      double worst = 0;
      for (size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::fabs(got[i] - (p[i] - 0.01 * trust * u[i])));
      EXPECT_LE(worst, 1e-13 * std::fabs(0.01 * trust)) << backend_name(b) << " tensor " << k;  // (|u| <= ~1)
      EXPECT_GT(std::fabs(trust - 1.0), 0.1);  // the ratio matters
    }
  }
}

// ---- float32, float64 and bfloat16 tensors in one optimizer ---------------------------------------

// The tensors of three sets (one dtype each) in one table: `a` in group 0, `b` and `c` in group 1.
std::vector<TensorRef> joined(HostTensorSet& a, HostTensorSet& b, HostTensorSet& c) {
  std::vector<TensorRef> out;
  for (HostTensorSet* s : {&a, &b, &c})
    for (TensorRef r : s->refs()) {
      r.group = s == &a ? 0 : 1;
      out.push_back(r);
    }
  return out;
}

TEST(Float64, MixedWithFloat32AndBfloat16InOneOptimizer) {
  // Each tensor within its own dtype's tolerance: float64 ones to 1e-12 where their math reads no
  // value of other tensors; a global reduction over the table (clip_by_global_norm, LAMB's clip) sums
  // the float32 and bfloat16 tensors' float32 math too (the clipped update the second clip reads),
  // so there the float64 tensors carry float32's error of that one number.
  const std::vector<TensorSpec> specs = {{1, 0}, {1023, 0}, {20000, 0}};
  struct Mixed {
    const char* spec;
    double f64_tolerance;
  };
  for (const Mixed& c : {Mixed{"adamw(lr=0.1, weight_decay=0.1)", kF64Tolerance}, Mixed{"lamb(lr=0.1, max_grad_norm=0)", kF64Tolerance},
                         Mixed{"adafactor(lr=0.01)", kF64Tolerance}, Mixed{"chain(clip_by_global_norm(1.0), lamb(lr=0.1))", 1e-6}}) {
    SCOPED_TRACE(c.spec);
    Chain chain = parse_chain(c.spec);
    Optimizer ref(chain, Backend::reference, 2), cpu(chain, Backend::cpu, 2);
    const Plan& plan = cpu.plan();
    HostTensorSet r32(plan, specs, DType::f32, 1), r64(plan, specs, DType::f64, 2), r16(plan, specs, DType::bf16, 3);
    HostTensorSet c32 = r32, c64 = r64, c16 = r16;
    ref.set_tensors(joined(r64, r32, r16));
    cpu.set_tensors(joined(c64, c32, c16));
    EXPECT_NE(cpu.backend_status().find("compiled"), std::string::npos) << cpu.backend_status();
    for (int s = 1; s <= 6; ++s) {
      for (HostTensorSet* x : {&r32, &r64, &r16, &c32, &c64, &c16}) x->randomize_grads(500 + static_cast<uint64_t>(s));
      ref.step();
      cpu.step();
      ASSERT_LE(max_scaled_difference(c64, r64), c.f64_tolerance) << "float64, step " << s;
      ASSERT_LE(max_scaled_difference(c32, r32), 1e-5) << "float32, step " << s;
      ASSERT_LE(max_scaled_difference(c16, r16), 2 * std::ldexp(1.0, -7)) << "bfloat16, step " << s;  // 2 ulps
    }
    // The float32 tensors still do float32 math: they differ from the float64 reference by more
    // than float64 rounding (where the float64 ones agree to ~1e-15).
    EXPECT_GT(max_scaled_difference(c32, r32), 1e-10);
  }
}

TEST(Float64, MixedTableStepsFloat64TensorsAsAlone) {
  // Per-tensor math (no global reduction): a float64 tensor's bytes do not depend on its neighbours.
  const std::vector<TensorSpec> specs = {{1, 0}, {3000, 0}, {70000, 0}};
  Chain chain = parse_chain("lamb(lr=0.1, max_grad_norm=0)");
  Optimizer mixed(chain, Backend::cpu, 2), alone(chain, Backend::cpu);
  const Plan& plan = mixed.plan();
  HostTensorSet m32(plan, specs, DType::f32, 1), m64(plan, specs, DType::f64, 2), m16(plan, specs, DType::bf16, 3);
  HostTensorSet a64 = m64;
  mixed.set_tensors(joined(m64, m32, m16));
  alone.set_tensors(a64.refs());
  for (int s = 1; s <= 4; ++s) {
    for (HostTensorSet* x : {&m32, &m64, &m16, &a64}) x->randomize_grads(900 + static_cast<uint64_t>(s));
    mixed.step();
    alone.step();
  }
  EXPECT_TRUE(same_bytes(m64, a64));
}

TEST(Float64, GeneratedSourceHasFloat64MathOnlyWhereAVariantNeedsIt) {
  Plan plan = make_plan(parse_chain("chain(clip_by_global_norm(1.0), lamb())"));
  const std::string plain = generate_cpu_source(plan);
  EXPECT_EQ(plain.find("_f64"), std::string::npos);  // float32/16-bit sources (and their cache keys) unchanged
  std::vector<StorageVariant> variants = default_variants(plan);
  variants.push_back(testing::role_storage(plan, DType::f64, DType::f64, DType::f64));
  variants.push_back(testing::role_storage(plan, DType::f64, DType::f32, DType::f32));
  EXPECT_TRUE(variant_computes_f64(variants[variants.size() - 1]));
  EXPECT_FALSE(variant_computes_f64(variants[0]));
  const std::string src = generate_cpu_source(plan, variants);
  EXPECT_NE(src.find("OF_FN void of_phase0_element_f64(double* v, const double* u, double* acc)"), std::string::npos);
  EXPECT_NE(src.find("of_phase1_tensor_f64(derived_row, tensor_row, u + "), std::string::npos);  // unrounded trust ratio
  EXPECT_NE(src.find("double* __restrict param_p"), std::string::npos);
  EXPECT_NE(src, plain);
}

// ---- the CPU backend without a compiler ------------------------------------------------------------

TEST(Float64, FallbackInterpreterComputesInFloat64) {
  const std::vector<TensorSpec> specs = {{1, 0}, {1023, 1}, {5000, 0}};
  for (const char* spec : {"chain(clip_by_global_norm(1.0), adamw(lr=0.1))", "lamb(lr=0.1)"}) {
    SCOPED_TRACE(spec);
    Chain chain = parse_chain(spec);
    Optimizer ref(chain, Backend::reference, 2), compiled(chain, Backend::cpu, 2);
    std::unique_ptr<Optimizer> fallback;
    {
      testing::ScopedEnv none("OPTFUSE_CXX", "none");
      fallback = std::make_unique<Optimizer>(chain, Backend::cpu, 2);
    }
    ASSERT_NE(fallback->backend_status().find("interpreted in float32"), std::string::npos) << fallback->backend_status();
    const Plan& plan = ref.plan();
    HostTensorSet r64(plan, specs, DType::f64, 4), r32(plan, specs, DType::f32, 5);
    HostTensorSet f64 = r64, f32 = r32, c64 = r64, c32 = r32;
    auto both = [](HostTensorSet& a, HostTensorSet& b) {
      std::vector<TensorRef> v = a.refs(), w = b.refs();
      v.insert(v.end(), w.begin(), w.end());
      return v;
    };
    ref.set_tensors(both(r64, r32));
    fallback->set_tensors(both(f64, f32));
    compiled.set_tensors(both(c64, c32));
    for (int s = 1; s <= 5; ++s) {
      for (HostTensorSet* x : {&r64, &r32, &f64, &f32, &c64, &c32}) x->randomize_grads(70 + static_cast<uint64_t>(s));
      ref.step();
      fallback->step();
      compiled.step();
    }
    EXPECT_LE(max_scaled_difference(f64, r64), kF64Tolerance);
    EXPECT_LE(max_scaled_difference(f64, c64), kF64Tolerance);
    // (its float32 tensors stay float32 math: as the compiled code's)
    EXPECT_LE(max_scaled_difference(f32, c32), 1e-6);
    EXPECT_GT(max_scaled_difference(f32, r32), 1e-10);
  }
}

TEST(Float64, AdafactorFallbackEqualsCompiledBitwise) {
  // Matrix plans: the compiled loops and the interpreter sum rows and columns in the same order.
  Chain chain = parse_chain("adafactor(lr=0.01)");
  Optimizer compiled(chain, Backend::cpu, 2);
  std::unique_ptr<Optimizer> fallback;
  {
    testing::ScopedEnv none("OPTFUSE_CXX", "none");
    fallback = std::make_unique<Optimizer>(chain, Backend::cpu, 2);
  }
  HostTensorSet a(compiled.plan(), kMatrices, DType::f64, 9), b = a;
  compiled.set_tensors(a.refs());
  fallback->set_tensors(b.refs());
  for (int s = 1; s <= 4; ++s) {
    a.randomize_grads(40 + static_cast<uint64_t>(s));
    b.randomize_grads(40 + static_cast<uint64_t>(s));
    compiled.step();
    fallback->step();
  }
  EXPECT_TRUE(same_bytes(a, b));
}

TEST(Float64, DtypeCodeNameAndParsing) {
  EXPECT_EQ(static_cast<int>(DType::f64), 4);  // appended: the codes of the other dtypes are unchanged
  EXPECT_EQ(static_cast<int>(DType::f32), 0);
  EXPECT_EQ(static_cast<int>(DType::bf16), 2);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_STREQ(dtype_name(DType::f64), "float64");
  for (const char* n : {"float64", "f64", "fp64", "double"}) EXPECT_EQ(parse_dtype(n), DType::f64) << n;
  double x[2] = {0, 0};
  store_element(x, DType::f64, 1, 1.0 + 1e-15);
  EXPECT_EQ(x[1], 1.0 + 1e-15);
  EXPECT_EQ(load_element(x, DType::f64, 1), 1.0 + 1e-15);
}

TEST(Float64, StochasticRoundingOfAFloat64BufferIsRefused) {
  Optimizer opt(parse_chain("sgd(lr=0.1)"), Backend::cpu);
  std::vector<double> p(4, 1.0), g(4, 0.5);
  TensorRef t;
  t.param = {p.data(), 4, DType::f64, true};
  t.grad = {g.data(), 4, DType::f64};
  EXPECT_THROW(opt.set_tensors({t}), Error);
}

}  // namespace
}  // namespace optfuse
