// q8 block-quantized states on the CUDA backend (issue 34; tests/cpu/test_q8_states.cpp has the
// codec's properties): without a GPU, NVRTC compiles kernels with q8 variants (beside the others in
// one source, with reductions and 16-bit roles); with one, a warp per block folds the same scale and
// encodes the same codes as the CPU loops: element-wise chains (no reductions, whose sums CUDA orders
// differently) are equal to the CPU backend byte for byte, the others within one code of the reference.
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

const std::vector<TensorSpec> kSpecs = {{1, 0}, {255, 1}, {256, 0}, {1023, 1}, {40000, 0}};

StorageVariant storage(const Plan& plan, DType param, DType states) {
  return optfuse::testing::role_storage(plan, param, param, states);
}

const char* const kElementWise[] = {"adamw(lr=0.01, weight_decay=0.1)", "sgd(lr=0.05, momentum=0.9, nesterov=true)",
                                    "lion(lr=0.001)"};
const char* const kWithReductions[] = {"chain(clip_by_global_norm(1.0), adamw(lr=0.01))", "lamb(lr=0.01)"};

TEST(CudaQ8Source, Q8KernelsCompileForSm90) {
  REQUIRE_NVRTC();
  std::vector<const char*> all(std::begin(kElementWise), std::end(kElementWise));
  all.insert(all.end(), std::begin(kWithReductions), std::end(kWithReductions));
  for (const char* spec : all) {
    SCOPED_TRACE(spec);
    Plan plan = make_plan(parse_chain(spec));
    std::vector<StorageVariant> variants = default_variants(plan);
    variants.push_back(storage(plan, DType::f32, DType::q8));
    variants.push_back(storage(plan, DType::bf16, DType::q8));
    variants.push_back(storage(plan, DType::f64, DType::q8));
    const std::string src = generate_cuda_source(plan, variants);
    EXPECT_NE(src.find("of_q8_encode((float)"), std::string::npos);
    EXPECT_NE(src.find("__shfl_xor_sync(0xffffffffu, scale, o)"), std::string::npos);
    EXPECT_NO_THROW(cu::compile(src, "optfuse", 90, {"--fmad=false"}));
  }
}

HostTensorSet run_host(const Chain& c, const HostTensorSet& set, Backend b, int steps) {
  return optfuse::testing::run_steps(c, Precision{}, set, b, steps, 1);
}

HostTensorSet run_cuda(const Chain& c, const HostTensorSet& set, int steps) {
  HostTensorSet s = set;
  Optimizer opt(c, Backend::cuda, 2);
  opt.set_hyper(1, "lr", opt.hyper(0, "lr") * 0.5);
  DeviceTensorSet dev(s);
  opt.set_tensors(dev.refs());
  for (int k = 0; k < steps; ++k) {
    s.randomize_grads(1000 + static_cast<uint64_t>(k));
    dev.upload_role(s, 1);
    opt.step();
  }
  dev.download(s);
  return s;
}

TEST(CudaQ8, ElementWiseChainsEqualTheCpuByteForByte) {
  REQUIRE_GPU();
  for (const char* spec : kElementWise)
    for (DType param : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(spec) + " / param " + dtype_name(param));
      Chain chain = parse_chain(spec);
      Plan plan = make_plan(chain);
      HostTensorSet set(plan, kSpecs, storage(plan, param, DType::q8), 3);
      HostTensorSet cpu = run_host(chain, set, Backend::cpu, 5), gpu = run_cuda(chain, set, 5);
      for (size_t t = 0; t < set.size(); ++t)
        for (size_t r = 0; r < set.num_roles(); ++r) EXPECT_EQ(cpu.bytes(t, r), gpu.bytes(t, r)) << "tensor " << t << " role " << r;
      EXPECT_GT(optfuse::testing::max_relative_difference(set, cpu), 1e-4);  // it moved
    }
}

TEST(CudaQ8, ChainsWithReductionsMatchTheReference) {
  REQUIRE_GPU();
  for (const char* spec : kWithReductions) {
    SCOPED_TRACE(spec);
    Chain chain = parse_chain(spec);
    Plan plan = make_plan(chain);
    HostTensorSet set(plan, kSpecs, storage(plan, DType::f32, DType::q8), 3);
    HostTensorSet ref = run_host(chain, set, Backend::reference, 5), gpu = run_cuda(chain, set, 5);
    EXPECT_LE(optfuse::testing::max_relative_difference(gpu, ref), 0.04);
    EXPECT_GT(optfuse::testing::max_relative_difference(set, ref), 1e-4);
  }
}

}  // namespace
