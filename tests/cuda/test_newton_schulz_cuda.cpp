// The matrix phase on CUDA (cuBLAS bf16 GEMMs and our norm/scale/store kernels): the kernels compile
// with NVRTC anywhere; on a GPU the results agree with the CPU path within bf16 rounding (the GEMM
// libraries sum in other orders), repeat bitwise, and a tall matrix is the wide one transposed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/require_cuda.h"
#include "matrix/newton_schulz_impl.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/dtype.h"
#include "optfuse/matrix_chain.h"
#include "optfuse/newton_schulz.h"
#include "runtime/cuda_api.h"
#include "testing/random_values.h"

namespace {

namespace cu = optfuse::cuda;
using optfuse::Backend;
using optfuse::DType;
using optfuse::NewtonSchulz;
using optfuse::testing::largest_abs;
using optfuse::testing::largest_difference;

TEST(NewtonSchulzCuda, KernelsCompileWithNvrtc) {
  REQUIRE_NVRTC();
  cu::CompileResult r = cu::compile(optfuse::newton_schulz_cuda_source(), "newton_schulz_test", 90);
  EXPECT_FALSE(r.cubin.empty());
  for (const char* k : {"of_ns_partials", "of_ns_norms", "of_ns_scale", "of_ns_store"}) {
    auto res = cu::resources_from_cubin(r.cubin, k);
    ASSERT_TRUE(res.has_value()) << k;
    EXPECT_EQ(res->local_bytes, 0) << k << " spills";
  }
}

#define REQUIRE_CUBLAS()                                                        \
  do {                                                                          \
    REQUIRE_GPU();                                                              \
    std::string why_;                                                           \
    if (!optfuse::gemm_available(Backend::cuda, &why_)) GTEST_SKIP() << why_;   \
    if (!optfuse::gemm_available(Backend::cpu, &why_)) GTEST_SKIP() << why_;    \
  } while (0)

std::vector<float> random_matrix(size_t n, unsigned seed) { return optfuse::testing::normal_values(n, seed); }

// Runs the batch through NewtonSchulz on the GPU (float32 storage) and returns it.
std::vector<float> on_gpu(const std::vector<float>& host, optfuse::MatrixBatchShape shape, int runs = 1) {
  cu::Stream stream;
  cu::DeviceBuffer d(host.size() * 4);
  NewtonSchulz ns(Backend::cuda, shape);
  std::vector<float> out(host.size());
  for (int r = 0; r < runs; ++r) {
    cu::copy_to_device(d.ptr(), host.data(), host.size() * 4, stream.get());
    ns.run(reinterpret_cast<void*>(d.ptr()), stream.get());
  }
  cu::copy_to_host(out.data(), d.ptr(), out.size() * 4, stream.get());
  return out;
}

TEST(NewtonSchulzCuda, AgreesWithTheCpuPathWithinBf16Rounding) {
  REQUIRE_CUBLAS();
  for (auto [b, r, c] : {std::tuple{3, 64, 96}, std::tuple{2, 160, 48}, std::tuple{1, 768, 768}}) {
    optfuse::MatrixBatchShape shape{DType::f32, b, r, c};
    std::vector<float> m = random_matrix(size_t(b) * r * c, 7), cpu = m;
    std::vector<float> gpu = on_gpu(m, shape);
    NewtonSchulz(Backend::cpu, shape).run(cpu.data());
    const double w = largest_difference(gpu, cpu), top = largest_abs(cpu);
    std::printf("%d x %d x %d: largest GPU-CPU difference %.3g (largest entry %.3g)\n", b, r, c, w, top);
    // The libraries sum the products in other orders, so some bf16 roundings flip and five
    // iterations carry them on: within 4 bf16 ulps of the largest entry (a bf16 ulp is 2^-7 to 2^-8
    // of a value). Measured on the H200: 2.5 ulps at most (768 x 768).
    EXPECT_LE(w, top / 32) << b << "x" << r << "x" << c;
  }
}

TEST(NewtonSchulzCuda, RepeatsBitwiseAndTallIsWideTransposed) {
  REQUIRE_CUBLAS();
  const int r = 96, c = 40;
  std::vector<float> tall = random_matrix(size_t(r) * c, 8), wide(tall.size());
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) wide[size_t(j) * r + i] = tall[size_t(i) * c + j];
  std::vector<float> once = on_gpu(tall, {DType::f32, 1, r, c}), again = on_gpu(tall, {DType::f32, 1, r, c}, 3);
  ASSERT_EQ(once, again) << "a repeated run differs";
  std::vector<float> w = on_gpu(wide, {DType::f32, 1, c, r}), back(w.size());
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) back[size_t(i) * c + j] = w[size_t(j) * r + i];
  EXPECT_LE(largest_difference(once, back), largest_abs(back) / 32);  // as above
}

TEST(NewtonSchulzCuda, Bf16StorageHoldsTheSameValuesAsFloat32) {
  REQUIRE_CUBLAS();
  const int b = 2, r = 32, c = 80;
  std::vector<float> m = random_matrix(size_t(b) * r * c, 9);
  std::vector<uint16_t> h(m.size());
  for (size_t i = 0; i < m.size(); ++i) h[i] = optfuse::float_to_bf16_bits(m[i]);
  std::vector<float> f32 = on_gpu(m, {DType::f32, b, r, c});
  cu::Stream stream;
  cu::DeviceBuffer d(h.size() * 2);
  cu::copy_to_device(d.ptr(), h.data(), h.size() * 2, stream.get());
  NewtonSchulz(Backend::cuda, {DType::bf16, b, r, c}).run(reinterpret_cast<void*>(d.ptr()), stream.get());
  cu::copy_to_host(h.data(), d.ptr(), h.size() * 2, stream.get());
  for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(optfuse::bf16_bits_to_float(h[i]), f32[i]) << i;
}

TEST(NewtonSchulzCuda, MuonChainAgreesWithTheCpuOne) {
  REQUIRE_CUBLAS();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 96}, {96, 64}, {64, 96}, {32, 32}};
  std::vector<std::vector<float>> p, g;
  for (size_t t = 0; t < shapes.size(); ++t) {
    p.push_back(random_matrix(size_t(shapes[t].first * shapes[t].second), 20 + unsigned(t)));
    for (float& x : p.back()) x *= 0.1f;
  }
  std::vector<std::vector<float>> cpu_p = p, cpu_buf, gpu_out(p.size());
  for (auto& m : p) cpu_buf.emplace_back(m.size(), 0.0f);
  cu::Stream stream;  // before the optimizers: they free their buffers on it when destroyed
  const optfuse::Chain muon = optfuse::make_builtin("muon", {{"lr", 0.02}});
  optfuse::MatrixChainOptimizer cpu(muon, Backend::cpu), gpu(muon, Backend::cuda);
  std::vector<cu::DeviceBuffer> dp, dg, db;
  std::vector<optfuse::TensorRef> cpu_refs, gpu_refs;
  for (size_t t = 0; t < p.size(); ++t) {
    const size_t n = p[t].size();
    dp.emplace_back(n * 4);
    dg.emplace_back(n * 4);
    db.emplace_back(n * 4);
    cu::copy_to_device(dp.back().ptr(), p[t].data(), n * 4, stream.get());
    cu::memset_zero(db.back().ptr(), n * 4, stream.get());
  }
  for (int step = 0; step < 5; ++step) {
    g.clear();
    cpu_refs.clear();
    gpu_refs.clear();
    for (size_t t = 0; t < p.size(); ++t) {
      const int64_t n = int64_t(p[t].size());
      g.push_back(random_matrix(p[t].size(), 100 + unsigned(step * 10 + t)));
      cu::copy_to_device(dg[t].ptr(), g[t].data(), size_t(n) * 4, stream.get());
      optfuse::TensorRef c, d;
      c.param = {cpu_p[t].data(), n, DType::f32};
      c.grad = {g[t].data(), n, DType::f32};
      c.states = {{cpu_buf[t].data(), n, DType::f32}};
      c.cols = shapes[t].second;
      d = c;
      d.param.data = reinterpret_cast<void*>(dp[t].ptr());
      d.grad.data = reinterpret_cast<void*>(dg[t].ptr());
      d.states[0].data = reinterpret_cast<void*>(db[t].ptr());
      cpu_refs.push_back(c);
      gpu_refs.push_back(d);
    }
    cpu.set_tensors(cpu_refs);
    gpu.set_tensors(gpu_refs);
    cpu.step();
    gpu.step({nullptr, nullptr, stream.get()});
  }
  double worst = 0;
  for (size_t t = 0; t < p.size(); ++t) {
    gpu_out[t].resize(p[t].size());
    cu::copy_to_host(gpu_out[t].data(), dp[t].ptr(), p[t].size() * 4, stream.get());
    worst = std::max(worst, largest_difference(gpu_out[t], cpu_p[t]));
  }
  std::printf("Muon chain, 5 steps, CUDA vs CPU: largest parameter difference %.3g\n", worst);
  std::fflush(stdout);
  // per step at most lr * ratio (<= 1.23) * (4 bf16 ulps of entries <= ~0.5: 1.6e-2)
  EXPECT_LE(worst, 5 * 0.02 * 1.23 * 1.6e-2);
  EXPECT_GT(largest_difference(gpu_out[0], p[0]), 0.01) << "the parameters moved";
  EXPECT_NE(gpu.describe().find("cuBLAS"), std::string::npos);
}

}  // namespace
