#include "testing/precision_cases.h"

#include <cmath>
#include <sstream>

#include "ir/low_precision.h"

namespace optfuse::testing {

StorageVariant role_storage(const Plan& plan, DType param, DType grad, DType states, bool stochastic) {
  StorageVariant v{{param, stochastic && dtype_is_low_precision_float(param)}, {grad, false}};
  for (const ProgramState& s : plan.program.states) {
    DType d = s.fixed_dtype ? s.dtype : (s.name == "kahan_comp" ? param : states);
    v.push_back({d, stochastic && dtype_is_low_precision_float(d) && !s.fixed_dtype});
  }
  return v;
}

std::vector<PrecisionCase> precision_cases() {
  Precision none, copy, rem, kahan_bf16, kahan_f16;
  copy.master = MasterWeights::copy;
  rem.master = MasterWeights::remainders;
  kahan_bf16.kahan = true;
  kahan_f16.kahan = true;
  kahan_f16.kahan_dtype = DType::f16;
  return {
      {"bf16 param, fp32 grad and states", none, DType::bf16, DType::f32, DType::f32, false},
      {"fp32 param, bf16 grad, fp16 states", none, DType::f32, DType::bf16, DType::f16, false},
      {"bf16 everything, stochastic", none, DType::bf16, DType::bf16, DType::bf16, true},
      {"fp16 everything, stochastic", none, DType::f16, DType::f16, DType::f16, true},
      {"master copy, bf16 param and grad", copy, DType::bf16, DType::bf16, DType::f32, false},
      {"master copy, fp16 param, bf16 states stochastic", copy, DType::f16, DType::f32, DType::bf16, true},
      {"remainders, fp32 grad", rem, DType::bf16, DType::f32, DType::f32, false},
      {"kahan bf16", kahan_bf16, DType::bf16, DType::bf16, DType::bf16, false},
      {"kahan fp16, fp32 states", kahan_f16, DType::f16, DType::f16, DType::f32, false},
  };
}

double ulp_tolerance(DType d) {
  switch (d) {
    case DType::bf16: return 2 * std::ldexp(1.0, -7);
    case DType::f16: return 2 * std::ldexp(1.0, -10);
    case DType::f64: return 1e-12;  // float64 math on both sides: only the order of operations differs
    default: return 1e-5;
  }
}

std::string compare_to_reference(const Plan& plan, const HostTensorSet& got, const HostTensorSet& want,
                                 double float32_tolerance) {
  std::ostringstream fail;
  auto scale_of = [&](size_t t, size_t role) {
    double s = 0;
    for (int64_t i = 0; i < want.specs()[t].numel; ++i) s = std::max(s, std::fabs(want.value(t, role, i)));
    return std::max(s, 1e-30);
  };
  for (size_t r = 0; r < want.num_roles(); ++r) {
    if (r == 1) continue;  // gradients are inputs
    const std::string name = r >= 2 ? plan.program.states[r - 2].name : "param";
    double worst = 0, tol = want.dtype(r) == DType::f32 ? float32_tolerance : ulp_tolerance(want.dtype(r));
    for (size_t t = 0; t < want.size(); ++t) {
      const double scale = scale_of(t, name == "kahan_comp" || name == "param_remainder" ? 0 : r);
      for (int64_t i = 0; i < want.specs()[t].numel; ++i) {
        double d;
        if (name == "param_remainder") {  // the rebuilt masters, float32 tolerance at the parameter's scale
          tol = float32_tolerance;
          float a = lowp::master_from_remainder(static_cast<float>(got.value(t, 0, i)), static_cast<float>(got.value(t, r, i)));
          float b = lowp::master_from_remainder(static_cast<float>(want.value(t, 0, i)), static_cast<float>(want.value(t, r, i)));
          d = std::fabs(static_cast<double>(a) - b);
        } else if (name == "kahan_comp") {
          tol = ulp_tolerance(want.dtype(0));
          d = std::fabs((got.value(t, 0, i) + got.value(t, r, i)) - (want.value(t, 0, i) + want.value(t, r, i)));
        } else {
          d = std::fabs(got.value(t, r, i) - want.value(t, r, i));
        }
        if (std::isnan(d) && std::isnan(got.value(t, r, i)) == std::isnan(want.value(t, r, i))) d = 0;
        worst = std::isnan(d) ? d : std::max(worst, d / scale);
      }
    }
    if (!(worst <= tol)) fail << "role " << r << " (" << name << ", " << dtype_name(want.dtype(r)) << "): " << worst << " > " << tol << "; ";
  }
  return fail.str();
}

HostTensorSet run_steps(const Chain& c, const Precision& prec, const HostTensorSet& set, Backend b, int steps,
                        uint64_t seed) {
  HostTensorSet s = set;
  Optimizer opt(c, b, 2, prec);
  opt.set_hyper(1, "lr", opt.hyper(0, "lr") * 0.5);
  opt.set_tensors(s.refs());
  for (int k = 0; k < steps; ++k) {
    s.randomize_grads(seed * 1000 + static_cast<uint64_t>(k));
    opt.step();
  }
  return s;
}

}  // namespace optfuse::testing
