// float64 tensors on the CUDA backend (issue 32; tests/cpu/test_float64.cpp for the properties):
// without a GPU, NVRTC compiles the float64 kernels (all-float64 variants and float64 mixed with
// float32 and bfloat16 in one table, every scope but rows and columns); with one, they match the
// reference evaluator to 1e-12 of each role's scale, also with roles misaligned differently (the
// scalar path and the 2-doubles-per-vector path). Matrix plans (Adafactor) refuse float64 tensors
// on CUDA with a clear error (their row and column tables are float32 on the device).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "codegen/cuda_source.h"
#include "cuda/require_cuda.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "runtime/cuda_api.h"
#include "testing/device_tensor_set.h"
#include "testing/precision_cases.h"
#include "testing/tensor_set.h"

namespace {

using namespace optfuse;
namespace cu = optfuse::cuda;
using optfuse::testing::DeviceTensorSet;
using optfuse::testing::HostTensorSet;
using optfuse::testing::TensorSpec;

const std::vector<TensorSpec> kSpecs = {{0, 0}, {1, 1}, {3, 0}, {1023, 1}, {65537, 0}};

// Chains of every scope but rows and columns: element-wise, global and per-tensor reductions,
// uniform states, states written ahead (LAMB).
const char* const kChains[] = {
    "adamw(lr=0.1, weight_decay=0.1)",
    "chain(clip_by_global_norm(1.0), lamb(lr=0.1))",
    "lars(lr=0.5, weight_decay=0.01, momentum=0.9)",
    "chain(unscale_by_grad_scale(), skip_if_nonfinite(), nadam(lr=0.1))",
    "lion(lr=0.1, weight_decay=0.5)",
};

TEST(CudaFloat64Source, Float64KernelsCompileForSm90) {
  REQUIRE_NVRTC();
  for (const char* spec : kChains) {
    SCOPED_TRACE(spec);
    Plan plan = make_plan(parse_chain(spec));
    std::vector<StorageVariant> variants = default_variants(plan);
    variants.push_back(optfuse::testing::role_storage(plan, DType::f64, DType::f64, DType::f64));
    variants.push_back(optfuse::testing::role_storage(plan, DType::f64, DType::f32, DType::f32));  // mixed widths
    variants.push_back(optfuse::testing::role_storage(plan, DType::f64, DType::bf16, DType::f64));
    const std::string src = generate_cuda_source(plan, variants);
    EXPECT_NE(src.find("of_phase0_element_f64(double* v, const double* u, double* acc)"), std::string::npos);
    EXPECT_NE(src.find("of_lane_d<4>"), std::string::npos);  // the 16-byte vector path: 2 doubles per word
    EXPECT_NE(src.find("of_store1d<4>"), std::string::npos);
    EXPECT_NO_THROW(cu::compile(src, "optfuse", 90, {"--fmad=false"}));
    // Sources without a float64 variant are unchanged (no _f64 functions, no double u).
    EXPECT_EQ(generate_cuda_source(plan).find("_element_f64"), std::string::npos);
  }
}

TEST(CudaFloat64Source, MatrixPlansRefuseFloat64Clearly) {
  Plan plan = make_plan(parse_chain("adafactor()"));
  std::vector<StorageVariant> variants = default_variants(plan);
  variants.push_back(optfuse::testing::role_storage(plan, DType::f64, DType::f64, DType::f64));
  try {
    generate_cuda_source(plan, variants);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cpu backend"), std::string::npos) << e.what();
  }
}

// max |a - b| / scale per role (scale: the role's largest |b|), every role but the gradient.
double max_scaled_difference(const HostTensorSet& a, const HostTensorSet& b) {
  double worst = 0;
  for (size_t r = 0; r < b.num_roles(); ++r) {
    if (r == 1) continue;
    double scale = 1e-300, diff = 0;
    for (size_t t = 0; t < b.size(); ++t)
      for (int64_t i = 0; i < b.numel(t, r); ++i) {
        const double x = a.value(t, r, i), y = b.value(t, r, i);
        if (std::isnan(x) != std::isnan(y)) return NAN;
        if (std::isnan(x)) continue;
        scale = std::max(scale, std::fabs(y));
        diff = std::max(diff, std::fabs(x - y));
      }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

TEST(CudaFloat64, MatchesReferenceToFloat64Precision) {
  REQUIRE_GPU();
  for (const char* spec : kChains)
    for (const std::vector<int>& offsets : {std::vector<int>{}, std::vector<int>{1, 0, 3, 2, 5}}) {
      SCOPED_TRACE(std::string(spec) + (offsets.empty() ? "" : " / misaligned roles"));
      Chain chain = parse_chain(spec);
      Optimizer ref(chain, Backend::reference, 2), opt(chain, Backend::cuda, 2);
      for (Optimizer* o : {&ref, &opt}) o->set_hyper(1, "lr", 0.5 * o->hyper(0, "lr"));
      HostTensorSet want(ref.plan(), kSpecs, DType::f64, 7), got(ref.plan(), kSpecs, DType::f64, 7);
      const HostTensorSet fresh = want;
      ref.set_tensors(want.refs());
      DeviceTensorSet dev(got, nullptr, offsets);
      opt.set_tensors(dev.refs());
      for (int s = 1; s <= 6; ++s) {
        want.randomize_grads(100 + static_cast<uint64_t>(s));
        got.randomize_grads(100 + static_cast<uint64_t>(s));
        dev.upload_role(got, 1);
        ref.step();
        opt.step();
        dev.download(got);
        ASSERT_LE(max_scaled_difference(got, want), 1e-12) << "step " << s;
      }
      EXPECT_GT(max_scaled_difference(fresh, want), 1e-4);
    }
}

TEST(CudaFloat64, MixedWithFloat32AndBfloat16InOneTable) {
  REQUIRE_GPU();
  // adamw: per-tensor math, so each dtype's tensors keep their own precision (float64 to 1e-12).
  Chain chain = parse_chain("adamw(lr=0.1, weight_decay=0.1)");
  Optimizer ref(chain, Backend::reference, 2), opt(chain, Backend::cuda, 2);
  const Plan& plan = ref.plan();
  const std::vector<TensorSpec> specs = {{1, 0}, {1023, 1}, {20000, 0}};
  HostTensorSet w64(plan, specs, DType::f64, 1), w32(plan, specs, DType::f32, 2), w16(plan, specs, DType::bf16, 3);
  HostTensorSet g64 = w64, g32 = w32, g16 = w16;
  DeviceTensorSet d64(g64), d32(g32), d16(g16);
  auto all = [](std::vector<TensorRef> a, const std::vector<TensorRef>& b, const std::vector<TensorRef>& c) {
    a.insert(a.end(), b.begin(), b.end());
    a.insert(a.end(), c.begin(), c.end());
    return a;
  };
  ref.set_tensors(all(w64.refs(), w32.refs(), w16.refs()));
  opt.set_tensors(all(d64.refs(), d32.refs(), d16.refs()));
  for (int s = 1; s <= 5; ++s) {
    for (HostTensorSet* x : {&w64, &w32, &w16, &g64, &g32, &g16}) x->randomize_grads(300 + static_cast<uint64_t>(s));
    d64.upload_role(g64, 1);
    d32.upload_role(g32, 1);
    d16.upload_role(g16, 1);
    ref.step();
    opt.step();
    d64.download(g64);
    d32.download(g32);
    d16.download(g16);
    ASSERT_LE(max_scaled_difference(g64, w64), 1e-12) << "step " << s;
    ASSERT_LE(max_scaled_difference(g32, w32), 1e-5) << "step " << s;
    ASSERT_LE(max_scaled_difference(g16, w16), 2 * std::ldexp(1.0, -7)) << "step " << s;
  }
}

}  // namespace
