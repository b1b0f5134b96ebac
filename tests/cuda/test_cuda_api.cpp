// Tests of the CUDA run-time layer. NVRTC tests need only the toolkit (no GPU); the rest skip with the
// reason when driver_available() is false.
#include "runtime/cuda_api.h"
#include "cuda/require_cuda.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace cu = optfuse::cuda;

namespace {

// `fill` writes out[i] = (i % 1000) * scale + offset: exact in float for the values used below.
const char* kFillSource = R"(
extern "C" __global__ void fill(float* out, unsigned n, float scale, float offset) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (float)(i % 1000u) * scale + offset;
}
)";

// Launch bounds, static shared memory and a local array, for the resource checks.
const char* kResourceSource = R"(
extern "C" __global__ void __launch_bounds__(256) tiled(float* out, unsigned n) {
  __shared__ float tile[300];
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x % 300] = (float)i;
  __syncthreads();
  if (i < n) out[i] = tile[(threadIdx.x + 1) % 300] + 1.0f;
}
extern "C" __global__ void spilly(double* out, int n) {
  double acc[40];
  for (int k = 0; k < 40; ++k) acc[k] = out[k * n + threadIdx.x];
  double s = 0;
  for (int k = 0; k < 40; ++k) s += acc[(k * 7 + n) % 40] * acc[k];
  out[threadIdx.x] = s;
}
extern "C" __global__ void dynamic_only(float* out) {
  extern __shared__ float d[];
  d[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = d[threadIdx.x ^ 1];
}
)";

float expected(unsigned i, float scale, float offset) {
  return static_cast<float>(i % 1000u) * scale + offset;
}

// Gives each test its own empty cache directory and restores the environment afterwards.
class CudaApi : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/optfuse-cuda-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ::setenv("OPTFUSE_CACHE_DIR", dir_.c_str(), 1);
    ::unsetenv("OPTFUSE_NO_CACHE");
  }
  void TearDown() override {
    std::string cmd = "rm -rf '" + dir_ + "'";
    (void)std::system(cmd.c_str());
    ::unsetenv("OPTFUSE_CACHE_DIR");
    ::unsetenv("OPTFUSE_NO_CACHE");
  }
  std::string dir_;
};

}  // namespace

// ---- NVRTC: runs without a GPU -----------------------------------------------------------------

TEST_F(CudaApi, CompilesForSm90AndCaches) {
  REQUIRE_NVRTC();
  cu::CompileResult a = cu::compile(kFillSource, "fill.cu", 90);
  EXPECT_FALSE(a.from_cache);
  ASSERT_GT(a.cubin.size(), 64u);
  EXPECT_EQ(a.cubin.compare(0, 4, "\x7f" "ELF"), 0);
  EXPECT_GE(a.seconds, 0.0);

  cu::CompileResult b = cu::compile(kFillSource, "fill.cu", 90);
  EXPECT_TRUE(b.from_cache);
  EXPECT_EQ(a.cubin, b.cubin);

  // Anything in the key changes the entry: options, architecture, source.
  EXPECT_FALSE(cu::compile(kFillSource, "fill.cu", 90, {"-DVARIANT=1"}).from_cache);
  EXPECT_FALSE(cu::compile(kFillSource, "fill.cu", 80).from_cache);
  EXPECT_FALSE(cu::compile(std::string(kFillSource) + "\n// edit\n", "fill.cu", 90).from_cache);
}

TEST_F(CudaApi, NoCacheEnvDisablesCache) {
  REQUIRE_NVRTC();
  ::setenv("OPTFUSE_NO_CACHE", "1", 1);
  EXPECT_FALSE(cu::compile(kFillSource, "fill.cu", 90).from_cache);
  EXPECT_FALSE(cu::compile(kFillSource, "fill.cu", 90).from_cache);
}

TEST_F(CudaApi, CorruptCacheEntryIsRecompiled) {
  REQUIRE_NVRTC();
  cu::CompileResult a = cu::compile(kFillSource, "fill.cu", 90);
  // Overwrite every cached file with garbage: the next compile must not return it.
  std::string cmd = "for f in '" + dir_ + "'/cuda/*.cubin; do echo junk > \"$f\"; done";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  cu::CompileResult b = cu::compile(kFillSource, "fill.cu", 90);
  EXPECT_FALSE(b.from_cache);
  EXPECT_EQ(a.cubin, b.cubin);
}

TEST_F(CudaApi, SyntaxErrorReportsLogAndNumberedSource) {
  REQUIRE_NVRTC();
  const std::string bad =
      "extern \"C\" __global__ void broken(float* out) {\n"
      "  out[0] = 1.0f   // missing semicolon\n"
      "}\n";
  try {
    cu::compile(bad, "broken.cu", 90);
    FAIL() << "expected optfuse::Error";
  } catch (const optfuse::BackendUnavailable& e) {
    FAIL() << "syntax error reported as BackendUnavailable: " << e.what();
  } catch (const optfuse::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("broken.cu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("error"), std::string::npos) << msg;  // from the NVRTC log
    EXPECT_NE(msg.find("expected a \";\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("NVRTC_ERROR_COMPILATION"), std::string::npos) << msg;
    EXPECT_NE(msg.find("    2 |   out[0] = 1.0f"), std::string::npos) << msg;
  }
}

TEST_F(CudaApi, RefusesFastMathAndUnknownArch) {
  REQUIRE_NVRTC();
  EXPECT_THROW(cu::compile(kFillSource, "fill.cu", 90, {"--use_fast_math"}), optfuse::Error);
  EXPECT_THROW(cu::compile(kFillSource, "fill.cu", 90, {"-prec-sqrt=false"}), optfuse::Error);
  try {
    cu::compile(kFillSource, "fill.cu", 12);
    FAIL() << "sm_12 accepted";
  } catch (const optfuse::Error& e) {
    EXPECT_NE(std::string(e.what()).find("supported:"), std::string::npos) << e.what();
  }
}

TEST_F(CudaApi, ResourcesFromCubinWithoutGpu) {
  REQUIRE_NVRTC();
  const std::string cubin = cu::compile(kResourceSource, "res.cu", 90).cubin;
  auto tiled = cu::resources_from_cubin(cubin, "tiled");
  ASSERT_TRUE(tiled.has_value());
  EXPECT_GT(tiled->registers, 0);
  EXPECT_LE(tiled->registers, 64);
  EXPECT_EQ(tiled->local_bytes, 0);
  EXPECT_EQ(tiled->shared_bytes, 300 * 4);  // the reserved 1 KiB window is not counted
  EXPECT_EQ(tiled->max_threads_per_block, 256);  // from __launch_bounds__(256)

  auto spilly = cu::resources_from_cubin(cubin, "spilly");
  ASSERT_TRUE(spilly.has_value());
  EXPECT_GT(spilly->registers, 0);
  EXPECT_GE(spilly->local_bytes, 40 * 8);  // the indexed local array lives in local memory
  EXPECT_EQ(spilly->shared_bytes, 0);
  EXPECT_GT(spilly->max_threads_per_block, 0);
  EXPECT_LE(spilly->max_threads_per_block, 1024);
  EXPECT_EQ(spilly->max_threads_per_block % 32, 0);

  auto dyn = cu::resources_from_cubin(cubin, "dynamic_only");
  ASSERT_TRUE(dyn.has_value());
  EXPECT_EQ(dyn->shared_bytes, 0);  // dynamic shared memory is given at launch, not in the cubin
  EXPECT_EQ(dyn->max_threads_per_block, 1024);

  EXPECT_THROW(cu::resources_from_cubin(cubin, "no_such_kernel"), optfuse::Error);
  EXPECT_THROW(cu::resources_from_cubin("not an elf", "tiled"), optfuse::Error);
}

// ---- Driver: needs a GPU --------------------------------------------------------------------

TEST(CudaDriver, UnavailableIsReportedNotThrown) {
  std::string why;
  if (cu::driver_available(&why)) {
    cu::Device d = cu::current_device();
    EXPECT_GT(d.sm_count, 0);
    EXPECT_GE(d.cc_major, 5);
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_mem, size_t(0));
  } else {
    EXPECT_FALSE(why.empty());
    EXPECT_THROW(cu::current_device(), optfuse::BackendUnavailable);
    EXPECT_THROW(cu::DeviceBuffer(16), optfuse::BackendUnavailable);
  }
}

TEST_F(CudaApi, LaunchWritesPatternAndGraphReplays) {
  REQUIRE_GPU();
  const cu::Device dev = cu::current_device();
  const cu::CompileResult cr = cu::compile(kFillSource, "fill.cu", dev.arch());
  cu::Module mod(cr.cubin);
  CUfunction fill = mod.function("fill");
  EXPECT_THROW(mod.function("nope"), optfuse::Error);

  const unsigned n = 1000003;
  cu::Stream stream;
  cu::DeviceBuffer buf(n * sizeof(float));
  ASSERT_EQ(buf.size(), n * sizeof(float));
  cu::memset_zero(buf.ptr(), buf.size(), stream.get());

  CUdeviceptr p = buf.ptr();
  unsigned nn = n;
  float scale = 0.5f, offset = 1.0f;
  void* args[] = {&p, &nn, &scale, &offset};
  const unsigned block = 256, grid = (n + block - 1) / block;
  cu::launch(fill, grid, block, 0, stream.get(), args);

  std::vector<float> host(n, -1.0f);
  cu::copy_to_host(host.data(), buf.ptr(), buf.size(), stream.get());
  size_t bad = 0;
  for (unsigned i = 0; i < n; ++i) bad += host[i] != expected(i, 0.5f, 1.0f);
  EXPECT_EQ(bad, 0u) << "first values: " << host[0] << " " << host[1] << " " << host[999];

  // Capture the same launch with other arguments (they are copied at capture time), clear the
  // buffer, replay twice and check the graph's values.
  scale = 2.0f;
  offset = -3.0f;
  cu::begin_capture(stream.get());
  cu::launch(fill, grid, block, 0, stream.get(), args);
  cu::Graph graph = cu::end_capture(stream.get());
  ASSERT_FALSE(graph.empty());
  for (int rep = 0; rep < 2; ++rep) {
    cu::memset_zero(buf.ptr(), buf.size(), stream.get());
    graph.launch(stream.get());
    std::fill(host.begin(), host.end(), -1.0f);
    cu::copy_to_host(host.data(), buf.ptr(), buf.size(), stream.get());
    bad = 0;
    for (unsigned i = 0; i < n; ++i) bad += host[i] != expected(i, 2.0f, -3.0f);
    EXPECT_EQ(bad, 0u) << "replay " << rep;
  }
}

TEST_F(CudaApi, CopyRoundTripAndTimer) {
  REQUIRE_GPU();
  const size_t n = 1 << 20;
  std::vector<float> src(n), dst(n, 0.0f);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i) * 0.25f;
  cu::Stream s;
  cu::DeviceBuffer a(n * sizeof(float));
  cu::EventTimer t;
  t.start(s.get());
  cu::copy_to_device(a.ptr(), src.data(), n * sizeof(float), s.get());
  std::fill(src.begin(), src.end(), 0.0f);  // allowed: src is reusable once the call returns
  t.stop(s.get());
  cu::copy_to_host(dst.data(), a.ptr(), n * sizeof(float), s.get());
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(dst[i], static_cast<float>(i) * 0.25f) << i;
  EXPECT_GE(t.elapsed_ms(), 0.0f);

  cu::DeviceBuffer moved = std::move(a);
  EXPECT_EQ(a.ptr(), CUdeviceptr(0));
  EXPECT_NE(moved.ptr(), CUdeviceptr(0));
  EXPECT_EQ(cu::DeviceBuffer(0).ptr(), CUdeviceptr(0));
}

TEST_F(CudaApi, DriverResourcesAgreeWithCubinParser) {
  REQUIRE_GPU();
  const cu::Device dev = cu::current_device();
  const std::string cubin = cu::compile(kResourceSource, "res.cu", dev.arch()).cubin;
  cu::Module mod(cubin);
  for (const char* k : {"tiled", "spilly", "dynamic_only"}) {
    const cu::KernelResources drv = mod.resources(k);
    const auto elf = cu::resources_from_cubin(cubin, k);
    ASSERT_TRUE(elf.has_value()) << k;
    EXPECT_EQ(elf->registers, drv.registers) << k;
    EXPECT_EQ(elf->local_bytes, drv.local_bytes) << k;
    EXPECT_EQ(elf->shared_bytes, drv.shared_bytes) << k;
    EXPECT_EQ(elf->max_threads_per_block, drv.max_threads_per_block) << k;
  }
}

TEST_F(CudaApi, FreshThreadsGetTheSameDevice) {
  REQUIRE_GPU();
  // Threads start with no current context: each one's first call makes the primary context current.
  const int main_ordinal = cu::current_device().ordinal;
  std::vector<std::thread> threads;
  std::vector<int> ordinals(8, -1), ok(8, 0);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      try {
        ordinals[t] = cu::current_device().ordinal;
        cu::DeviceBuffer b(4096);
        std::vector<unsigned char> h(4096, 0xab);
        cu::memset_zero(b.ptr(), b.size(), nullptr);
        cu::copy_to_host(h.data(), b.ptr(), h.size(), nullptr);
        ok[t] = h[0] == 0 && h[4095] == 0;
      } catch (const std::exception&) {
        ok[t] = 0;
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) {
    EXPECT_EQ(ordinals[t], main_ordinal) << t;
    EXPECT_TRUE(ok[t]) << t;
  }
}
