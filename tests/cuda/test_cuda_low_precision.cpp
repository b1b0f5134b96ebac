// Mixed precision on the CUDA backend (see tests/cpu/test_low_precision.cpp for the properties):
// without a GPU, NVRTC compiles kernels for mixed storage variants; with one, every option and
// dtype combination matches the reference, also with roles misaligned differently (the scalar path
// and the mixed-width vector path), and stochastic stores equal the CPU backend's bit for bit.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "codegen/cuda_source.h"
#include "cuda/require_cuda.h"
#include "optfuse/builtin_rules.h"
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

TEST(CudaLowPrecisionSource, MixedVariantsCompileForSm90) {
  REQUIRE_NVRTC();
  for (const char* spec : {"adamw()", "chain(clip_by_global_norm(1.0), sgd(momentum=0.9))"})
    for (const optfuse::testing::PrecisionCase& c : optfuse::testing::precision_cases()) {
      SCOPED_TRACE(std::string(spec) + " / " + c.name);
      Plan plan = make_plan(parse_chain(spec), c.prec);
      std::vector<StorageVariant> variants = default_variants(plan);
      variants.push_back(optfuse::testing::role_storage(plan, c.param, c.grad, c.states, c.stochastic));
      std::string src = generate_cuda_source(plan, variants);
      EXPECT_NE(src.find("_v" + std::to_string(variants.size() - 1) + "_chunk"), std::string::npos);
      EXPECT_NO_THROW(cu::compile(src, "optfuse", 90, {"--fmad=false"}));
    }
}

// Steps on CUDA and the reference evaluator with the same gradients; "" or what failed.
std::string vs_reference(const Chain& chain, const optfuse::testing::PrecisionCase& c, const std::vector<int>& offsets) {
  Plan plan = make_plan(chain, c.prec);
  StorageVariant storage = optfuse::testing::role_storage(plan, c.param, c.grad, c.states, c.stochastic);
  Optimizer ref(chain, Backend::reference, 2, c.prec), opt(chain, Backend::cuda, 2, c.prec);
  for (Optimizer* o : {&ref, &opt}) o->set_hyper(1, "lr", 0.5 * o->hyper(0, "lr"));
  HostTensorSet want(plan, kSpecs, storage, 7), got(plan, kSpecs, storage, 7);
  ref.set_tensors(want.refs());
  DeviceTensorSet dev(got, nullptr, offsets);
  opt.set_tensors(dev.refs());
  std::string fail;
  for (int s = 0; s < 6 && fail.empty(); ++s) {
    want.randomize_grads(100 + static_cast<uint64_t>(s));
    got.randomize_grads(100 + static_cast<uint64_t>(s));
    dev.upload_role(got, 1);
    ref.step();
    opt.step();
    dev.download(got);
    // Stochastically rounded states one ulp apart (where float32 and float64 differ) move a float32
    // master by lr x 2^-8 of its update: 1e-4 of the scale then, 1e-5 otherwise.
    fail = optfuse::testing::compare_to_reference(plan, got, want, c.stochastic ? 1e-4 : 1e-5);
    if (!fail.empty()) fail = "step " + std::to_string(s + 1) + ": " + fail;
  }
  return fail;
}

TEST(CudaLowPrecision, MatchesReferenceForEveryOptionAndDtype) {
  REQUIRE_GPU();
  for (const char* spec : {"adamw(lr=0.01, weight_decay=0.1)", "chain(clip_by_global_norm(1.0), sgd(lr=0.05, momentum=0.9))"})
    for (const optfuse::testing::PrecisionCase& c : optfuse::testing::precision_cases())
      for (const std::vector<int>& offsets : {std::vector<int>{}, std::vector<int>{1, 0, 3, 2, 5}}) {
        SCOPED_TRACE(std::string(spec) + " / " + c.name + (offsets.empty() ? "" : " / misaligned roles"));
        EXPECT_EQ(vs_reference(parse_chain(spec), c, offsets), "");
      }
}

// Power-of-two lr and short mantissas: float32 and float64 compute the same values, so stochastic
// stores see the same numbers and bits on every backend.
TEST(CudaLowPrecision, StochasticStoresEqualTheCpuBackendBitwise) {
  REQUIRE_GPU();
  Chain c = sgd({{"lr", 0x1.0p-12}});
  Plan plan = make_plan(c);
  for (DType d : {DType::bf16, DType::f16})
    for (const std::vector<int>& offsets : {std::vector<int>{}, std::vector<int>{0, 1, 0}}) {
      StorageVariant storage = optfuse::testing::role_storage(plan, d, d, d, true);
      HostTensorSet host(plan, kSpecs, storage, 5), gpu(plan, kSpecs, storage, 5);
      Optimizer cpu(c, Backend::cpu, 2), cuda(c, Backend::cuda, 2);
      cpu.set_tensors(host.refs());
      DeviceTensorSet dev(gpu, nullptr, offsets);
      cuda.set_tensors(dev.refs());
      for (int s = 0; s < 4; ++s) {
        host.randomize_grads(50 + static_cast<uint64_t>(s));
        gpu.randomize_grads(50 + static_cast<uint64_t>(s));
        dev.upload_role(gpu, 1);
        cpu.step();
        cuda.step();
      }
      dev.download(gpu);
      for (size_t t = 0; t < host.size(); ++t)
        EXPECT_EQ(host.bytes(t, 0), gpu.bytes(t, 0)) << dtype_name(d) << " tensor " << t << (offsets.empty() ? "" : " misaligned");
    }
}

}  // namespace
