// States written ahead on CUDA (make_plan's write_states_ahead; tests/cpu/test_states_ahead.cpp has
// the plan and the CPU side): LAMB's reduce kernel writes m and v and its update kernel reads them
// back, bitwise the same chain planned without the move, in float32 and (the recomputing forms) in
// bfloat16 and float16; and the CUDA result matches the CPU backend's within float32 rounding.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/require_cuda.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/optimizer.h"
#include "runtime/cuda_api.h"
#include "testing/device_tensor_set.h"
#include "testing/tensor_set.h"

namespace optfuse {
namespace {

namespace cu = optfuse::cuda;
using testing::DeviceTensorSet;
using testing::HostTensorSet;
using testing::TensorSpec;

const std::vector<TensorSpec> kSpecs = {{0, 0}, {1, 0}, {3, 1}, {1023, 0}, {65537, 1}, {1 << 20, 1}};

// Every role but the gradient after `steps` steps of `spec` on CUDA.
std::vector<std::vector<uint8_t>> run_cuda(const std::string& spec, DType d, int steps, HostTensorSet* out = nullptr) {
  Optimizer opt(parse_chain(spec), Backend::cuda, 2);
  HostTensorSet host(opt.plan(), kSpecs, d, 13);
  DeviceTensorSet dev(host);
  opt.set_tensors(dev.refs());
  for (int s = 1; s <= steps; ++s) {
    host.randomize_grads(900 + static_cast<uint64_t>(s));
    dev.upload_role(host, 1);
    opt.step();
  }
  dev.download(host);
  std::vector<std::vector<uint8_t>> roles;
  for (size_t t = 0; t < host.size(); ++t)
    for (size_t r = 0; r < host.num_roles(); ++r)
      if (r != 1) roles.push_back(host.bytes(t, r));
  if (out) *out = host;
  return roles;
}

TEST(CudaStatesAhead, SameBitsAsTheUpdateKernelComputingThem) {
  REQUIRE_GPU();
  const std::string ahead = "lamb(lr=0.1)", plain = "chain(lamb(lr=0.1), skip_if_nonfinite())";
  ASSERT_FALSE(make_plan(parse_chain(ahead)).recomputing.empty());
  ASSERT_TRUE(make_plan(parse_chain(plain)).recomputing.empty());
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(d));
    EXPECT_EQ(run_cuda(ahead, d, 5), run_cuda(plain, d, 5));
  }
}

TEST(CudaStatesAhead, MatchesTheCpuBackend) {
  REQUIRE_GPU();
  const std::string spec = "chain(unscale_by_grad_scale(), lamb(lr=0.1))";
  Optimizer probe(parse_chain(spec), Backend::cpu, 2);
  HostTensorSet gpu(probe.plan(), kSpecs, DType::f32, 13), cpu(probe.plan(), kSpecs, DType::f32, 13),
      fresh(probe.plan(), kSpecs, DType::f32, 13);
  run_cuda(spec, DType::f32, 5, &gpu);
  probe.set_tensors(cpu.refs());
  for (int s = 1; s <= 5; ++s) {
    cpu.randomize_grads(900 + static_cast<uint64_t>(s));
    probe.step();
  }
  EXPECT_LE(testing::max_relative_difference(gpu, cpu), 2e-6);
  EXPECT_GT(testing::max_relative_difference(fresh, cpu), 1e-3);  // the step moved something
}

}  // namespace
}  // namespace optfuse
