// optfuse bench: times a step of a chain on a named workload and reports it against the floor set
// by memory bandwidth. An optimizer step is a streaming pass (or a few) over memory, so the honest
// yardstick is not FLOPs but "how close to a plain copy of the same bytes":
//   floor = bytes per element of the plan (sum over phases of reads + writes, times the dtype
//           size) x elements / copy bandwidth,
// where the copy bandwidth (bytes read + written per second) is measured first, in the same run,
// over buffers as large as the workload (so caches cannot flatter it). The CPU copy uses the same
// thread pool as the CPU backend. Two copies are timed on each device and the faster one sets the
// floor: memcpy and a streaming-store copy on the CPU; on CUDA a 16-byte-vectorised kernel and the
// driver's device-to-device memcpy (cuMemcpyDtoDAsync), both on the bench's stream.
// Gradients are random (never zero, so no path is short-circuited) and fixed across steps;
// parameters are random and states start at their init values.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <thread>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "codegen/c_printer.h"
#include "commands.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "runtime/cuda_api.h"
#include "runtime/thread_pool.h"
#include "testing/workloads.h"

namespace optfuse::cli {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

int parse_int(const std::string& name, const std::string& text, int min) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end || v < min || v > 1000000)
    throw Error("--" + name + " must be an integer >= " + std::to_string(min) + ", got '" + text + "'");
  return static_cast<int>(v);
}

// A progress bar on stderr, only when stderr is a terminal: redirected logs stay free of \r noise.
class Progress {
 public:
  Progress() : tty_(::isatty(2) != 0) {}
  void update(const char* label, int done, int total) {
    if (!tty_ || (done != total && seconds_since(last_) < 0.1)) return;
    last_ = Clock::now();
    const int width = 30, filled = total ? width * done / total : width;
    std::fprintf(stderr, "\r%-10s [%s%s] %d/%d", label, std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), done, total);
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (shown_) std::fprintf(stderr, "\r%-60s\r", "");
    shown_ = false;
  }

 private:
  bool tty_, shown_ = false;
  Clock::time_point last_{};
};

struct Result {
  std::string device, backend_status, copy_method;
  double copy_bps = 0;  // bytes read + written per second: the best method's median
  std::vector<std::pair<std::string, double>> copy_methods;  // every method's median
  int copy_runs = 0;
  std::vector<double> step_s;
  double setup_s = 0;
};

// ---------------------------------------------------------------------------------------------
// CPU

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown CPU";
}

// Records one copy method's bandwidth; the fastest method sets the floor (CPU and CUDA alike).
void record_copy_method(Result& r, const std::string& name, double bps) {
  r.copy_methods.emplace_back(name, bps);
  if (bps > r.copy_bps) {
    r.copy_bps = bps;
    r.copy_method = name;
  }
}

// The strongest plain copy we know how to write, so that the floor is one: streaming
// (non-temporal) stores -- a copy with ordinary stores also reads every destination line first
// (write-allocate), moving 3 bytes per 2 counted, which an in-place optimizer step never pays --
// over 4 interleaved streams with software prefetch. With few cores, a core's misses in flight
// rather than DRAM limit a copy, and a single-stream copy then understates what memory delivers
// to a kernel that streams 4-7 arrays (measured on a 2-core VM: 30 GB/s single-stream vs 43 GB/s
// like this; docs/performance.md).
void stream_copy(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  constexpr int kStreams = 4;
  constexpr size_t kAhead = 1024;
  const size_t part = bytes / kStreams / 64 * 64;
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0 && part > 0) {
    for (size_t i = 0; i < part; i += 64) {
      for (int k = 0; k < kStreams; ++k) {
        const char* s = src + static_cast<size_t>(k) * part + i;
        char* d = dst + static_cast<size_t>(k) * part + i;
        __builtin_prefetch(s + kAhead);
        __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(s));
        __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(s + 16));
        __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(s + 32));
        __m128i e = _mm_load_si128(reinterpret_cast<const __m128i*>(s + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
      }
    }
    _mm_sfence();
    const size_t done = kStreams * part;
    std::memcpy(dst + done, src + done, bytes - done);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Multi-threaded copy of total/2 bytes into another total/2 bytes (so the footprint equals the
// workload's), best of the two copy methods, median of `runs` timed copies each. The buffers are
// freed before the workload is allocated, so peak memory is the workload's.
void measure_cpu_copy(size_t total, int runs, Result& r, Progress& progress) {
  const size_t half = std::max<size_t>(total / 2 / 64 * 64, 64);
  char* src = static_cast<char*>(std::aligned_alloc(64, half));
  char* dst = static_cast<char*>(std::aligned_alloc(64, half));
  if (!src || !dst) {
    std::free(src);
    std::free(dst);
    throw Error("out of host memory: cannot allocate 2 x " + std::to_string(half) + " bytes for the copy test");
  }
  ThreadPool& pool = default_thread_pool();
  // Several slices per thread so a slow thread does not hold the others up, but of at least 4 MiB
  // where the buffers allow it (one memcpy call per slice: large calls take glibc's streaming path).
  const int64_t slices = std::max<int64_t>(pool.size(), std::min<int64_t>(pool.size() * 8, static_cast<int64_t>(half >> 22)));
  const size_t slice = (half / static_cast<size_t>(slices) + 63) / 64 * 64;
  auto for_slices = [&](const std::function<void(char*, const char*, size_t)>& op) {
    pool.parallel_for(slices, [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s) {
        size_t off = static_cast<size_t>(s) * slice;
        if (off < half) op(dst + off, src + off, std::min(slice, half - off));
      }
    });
  };
  // Touch every page from the pool's threads first: page faults are not bandwidth.
  for_slices([](char* d, const char* s, size_t n) {
    std::memset(const_cast<char*>(s), 1, n);
    std::memset(d, 0, n);
  });
  struct Method { const char* name; void (*fn)(char*, const char*, size_t); };
  const Method methods[] = {{"memcpy", [](char* d, const char* s, size_t n) { std::memcpy(d, s, n); }},
                            {"4-stream streaming-store copy", stream_copy}};
  int done = 0;
  for (const Method& m : methods) {
    std::vector<double> t;
    for (int i = 0; i <= runs; ++i) {  // the first run is a warm-up
      auto t0 = Clock::now();
      for_slices(m.fn);
      if (i > 0) t.push_back(seconds_since(t0));
      progress.update("copy", ++done, 2 * (runs + 1));
    }
    record_copy_method(r, m.name, 2.0 * static_cast<double>(half) / median(t));
  }
  r.copy_runs = runs;
  std::free(src);
  std::free(dst);
}

void bench_cpu(const Chain& chain, const testing::Workload& w, DType dtype, int steps, int warmup,
               int64_t bytes_per_step, Result& r) {
  Progress progress;
  auto t0 = Clock::now();
  Optimizer opt(chain, Backend::cpu);  // compiles (or loads from the cache) now
  r.backend_status = opt.backend_status();
  r.device = cpu_model() + ", " + std::to_string(std::thread::hardware_concurrency()) + " CPUs online, " +
             std::to_string(default_thread_count()) + " threads";
  measure_cpu_copy(static_cast<size_t>(bytes_per_step), 5, r, progress);
  testing::HostWorkloadMemory mem(opt.plan(), w, dtype, 1234);
  opt.set_tensors(mem.refs());
  r.setup_s = seconds_since(t0);
  for (int i = 0; i < warmup; ++i) {
    opt.step();
    progress.update("warm-up", i + 1, warmup);
  }
  for (int i = 0; i < steps; ++i) {
    auto s0 = Clock::now();
    opt.step();
    r.step_s.push_back(seconds_since(s0));
    progress.update("steps", i + 1, steps);
  }
  progress.clear();
}

// ---------------------------------------------------------------------------------------------
// CUDA

// Device-side helpers compiled once per run with NVRTC: a 16-byte-vectorised copy (4 loads in
// flight per thread before the stores) and a fill with the same generator as the host fill, using
// the CUDA dialect's own float -> bf16/f16 conversions so low-precision storage rounds as in steps.
std::string cuda_helpers_source(const Plan& plan) {
  std::string s = CPrinter(plan, cuda_dialect()).prelude();
  s += R"(
struct alignas(16) of_v4 { unsigned a, b, c, d; };
extern "C" __global__ void of_bench_copy(const of_v4* __restrict__ src, of_v4* __restrict__ dst,
                                         unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    of_v4 x0 = src[i], x1 = src[i + stride], x2 = src[i + 2 * stride], x3 = src[i + 3 * stride];
    dst[i] = x0; dst[i + stride] = x1; dst[i + 2 * stride] = x2; dst[i + 3 * stride] = x3;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}
__device__ unsigned long long of_splitmix64(unsigned long long x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
extern "C" __global__ void of_bench_fill(void* p, unsigned long long n, int dtype, int random, float value,
                                         unsigned long long key) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    float x = value;
    if (random) x = ((float)(of_splitmix64(key ^ i) >> 41) + 0.5f) * (1.0f / 4194304.0f) - 1.0f;
    if (dtype == 0) ((float*)p)[i] = x;
    else if (dtype == 4) ((double*)p)[i] = (double)x;  // float64 (DType::f64)
    else if (dtype == 1) ((unsigned short*)p)[i] = of_float_to_f16(x);
    else ((unsigned short*)p)[i] = of_float_to_bf16(x);
  }
}
)";
  return s;
}

void bench_cuda(const Chain& chain, const testing::Workload& w, DType dtype, int steps, int warmup,
                int64_t bytes_per_step, Result& r) {
  std::string why;
  if (!cuda::driver_available(&why)) throw BackendUnavailable("no usable CUDA driver/device: " + why);
  Progress progress;
  auto t0 = Clock::now();
  Optimizer opt(chain, Backend::cuda);  // BackendUnavailable here is reported by the caller
  r.backend_status = opt.backend_status();
  cuda::Device dev = cuda::current_device();
  r.device = dev.name + " (sm_" + std::to_string(dev.arch()) + ", " + std::to_string(dev.sm_count) + " SMs, " +
             std::to_string(dev.total_mem >> 30) + " GiB)";
  cuda::Stream stream;
  cuda::CompileResult helpers = cuda::compile(cuda_helpers_source(opt.plan()), "optfuse_bench", dev.arch());
  cuda::Module mod(helpers.cubin);
  CUfunction copy_fn = mod.function("of_bench_copy"), fill_fn = mod.function("of_bench_fill");
  const unsigned block = 256, grid = static_cast<unsigned>(std::max(1, dev.sm_count) * 8);

  {  // Copy bandwidth over buffers as large as the workload (two halves), freed before it exists.
    // Two copies, median of `runs` timed copies each after a warm-up, and the faster one is the
    // floor (as on the CPU): our vectorised kernel, and the driver's device-to-device memcpy
    // (cuMemcpyDtoDAsync, what cudaMemcpyAsync and torch's copy_ use), which is faster on some GPUs.
    const size_t half = std::max<size_t>(static_cast<size_t>(bytes_per_step) / 2 / 16 * 16, 16);
    cuda::DeviceBuffer src(half), dst(half);
    cuda::memset_zero(src.ptr(), half, stream.get());
    cuda::memset_zero(dst.ptr(), half, stream.get());
    CUdeviceptr s = src.ptr(), d = dst.ptr();
    unsigned long long n = half / 16;
    struct Method { const char* name; std::function<void()> run; };
    const Method methods[] = {
        {"16-byte vectorised copy kernel",
         [&] {
           void* args[] = {&s, &d, &n};
           cuda::launch(copy_fn, grid, block, 0, stream.get(), args);
         }},
        {"cuMemcpyDtoDAsync", [&] { cuda::copy_device_to_device(d, s, half, stream.get()); }}};
    cuda::EventTimer timer;
    const int runs = 10;
    int done = 0;
    for (const Method& m : methods) {
      std::vector<double> t;
      for (int i = 0; i <= runs; ++i) {  // the first is a warm-up
        timer.start(stream.get());
        m.run();
        timer.stop(stream.get());
        double ms = timer.elapsed_ms();
        if (i > 0) t.push_back(ms * 1e-3);
        progress.update("copy", ++done, 2 * (runs + 1));
      }
      record_copy_method(r, m.name, 2.0 * static_cast<double>(half) / median(t));
    }
    r.copy_runs = runs;
  }

  // Workload memory: one buffer per role, every tensor at a 256-byte-aligned offset.
  const size_t roles = 2 + static_cast<size_t>(opt.plan().num_states()), esize = dtype_size(dtype);
  std::vector<size_t> offsets;
  size_t per_role = 0;
  for (const auto& t : w.tensors) {
    offsets.push_back(per_role);
    per_role += (static_cast<size_t>(t.numel) * esize + 255) / 256 * 256;
  }
  std::vector<cuda::DeviceBuffer> bufs;
  for (size_t role = 0; role < roles; ++role) {
    bufs.emplace_back(per_role);
    int random = role < 2;
    float value = random ? 0.0f : static_cast<float>(opt.plan().program.states[role - 2].init);
    for (size_t t = 0; t < w.tensors.size(); ++t) {
      CUdeviceptr p = bufs.back().ptr() + offsets[t];
      unsigned long long n = static_cast<unsigned long long>(w.tensors[t].numel);
      int dt = static_cast<int>(dtype);
      unsigned long long key = 1234ull * 1000003ull + role * 7919ull + t;
      void* args[] = {&p, &n, &dt, &random, &value, &key};
      unsigned g = static_cast<unsigned>(std::min<unsigned long long>(grid, (n + block - 1) / block));
      cuda::launch(fill_fn, g, block, 0, stream.get(), args);
    }
  }
  std::vector<TensorRef> refs;
  for (size_t t = 0; t < w.tensors.size(); ++t) {
    auto buf = [&](size_t role) {
      return Buffer{reinterpret_cast<void*>(bufs[role].ptr() + offsets[t]), w.tensors[t].numel, dtype};
    };
    TensorRef ref;
    ref.param = buf(0);
    ref.grad = buf(1);
    for (size_t role = 2; role < roles; ++role) ref.states.push_back(buf(role));
    refs.push_back(ref);
  }
  stream.synchronize();
  opt.set_tensors(refs);
  r.setup_s = seconds_since(t0);

  StepInputs in;
  in.stream = stream.get();
  for (int i = 0; i < warmup; ++i) {
    opt.step(in);
    progress.update("warm-up", i + 1, warmup);
  }
  stream.synchronize();
  cuda::EventTimer timer;
  for (int i = 0; i < steps; ++i) {
    timer.start(stream.get());
    opt.step(in);
    timer.stop(stream.get());
    r.step_s.push_back(timer.elapsed_ms() * 1e-3);
    progress.update("steps", i + 1, steps);
  }
  stream.synchronize();
  progress.clear();
}

// ---------------------------------------------------------------------------------------------
// Reporting

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += c;
  }
  return o + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

}  // namespace

int bench_command(const Argv& args) {
  Options o = parse_options(args, {"chain", "workload", "scale", "backend", "dtype", "steps", "warmup", "json",
                                   "threads"}, {});
  if (!o.positional.empty())
    throw Error("bench takes no positional arguments (got '" + o.positional[0] + "'); use --chain SPEC");
  const std::string spec = o.get("chain", "adamw()");
  const std::string backend_text = o.get("backend", "cpu");
  if (backend_text != "cpu" && backend_text != "cuda")
    throw Error("bench --backend must be cpu or cuda, got '" + backend_text + "'");
  const Backend backend = parse_backend(backend_text);
  const DType dtype = parse_dtype(o.get("dtype", "float32"));
  const int steps = parse_int("steps", o.get("steps", "20"), 1);
  const int warmup = parse_int("warmup", o.get("warmup", "3"), 0);
  const std::string scale_text = o.get("scale", "1");
  char* end = nullptr;
  const double scale = std::strtod(scale_text.c_str(), &end);
  if (scale_text.empty() || *end) throw Error("--scale must be a number, got '" + scale_text + "'");
  if (o.flag("threads")) {
    if (backend != Backend::cpu) throw Error("--threads applies to the CPU backend only");
    // The CPU backend's pool reads this on first use, which is after this point.
    int threads = parse_int("threads", o.get("threads", ""), 1);
    ::setenv("OPTFUSE_NUM_THREADS", std::to_string(threads).c_str(), 1);
  }
  const testing::Workload w = testing::make_workload(o.get("workload", "one-big"), scale);
  const Chain chain = parse_chain(spec);
  const Plan plan = make_plan(chain);
  const int64_t elems = w.total_elements();
  const int64_t per_elem = testing::plan_bytes_per_element(plan, dtype);
  const int64_t bytes_per_step = per_elem * elems;

  Result r;
  try {
    if (backend == Backend::cpu) bench_cpu(chain, w, dtype, steps, warmup, bytes_per_step, r);
    else bench_cuda(chain, w, dtype, steps, warmup, bytes_per_step, r);
  } catch (const BackendUnavailable& e) {
    std::fprintf(stderr, "optfuse bench: the %s backend is not available here: %s\n", backend_text.c_str(), e.what());
    return 3;
  }

  const double med = median(r.step_s), mn = *std::min_element(r.step_s.begin(), r.step_s.end());
  const double floor_s = static_cast<double>(bytes_per_step) / r.copy_bps;
  const double eff_bps = static_cast<double>(bytes_per_step) / med;
  char line[512];
  std::cout << "chain:      " << plan.program.chain_text << "\n";
  std::snprintf(line, sizeof line, "workload:   %s (scale %g): %zu tensors, %s elements, %s\n", w.name.c_str(), scale,
                w.tensors.size(), with_commas(elems).c_str(), dtype_name(dtype));
  std::cout << line << "backend:    " << backend_text << ": " << r.backend_status << "\n"
            << "device:     " << r.device << "\n";
  std::snprintf(line, sizeof line, "plan:       %zu pass(es) over memory, %lld bytes per element, %.3f GB per step\n",
                plan.phases.size(), static_cast<long long>(per_elem), static_cast<double>(bytes_per_step) * 1e-9);
  std::cout << line;
  std::string methods;
  for (const auto& m : r.copy_methods) {
    std::snprintf(line, sizeof line, "%s%s %.2f", methods.empty() ? "" : ", ", m.first.c_str(), m.second * 1e-9);
    methods += line;
  }
  std::snprintf(line, sizeof line, "copy:       %.2f GB/s read + written (%s; medians of %d over %.3f GB: %s)\n",
                r.copy_bps * 1e-9, r.copy_method.c_str(), r.copy_runs, static_cast<double>(bytes_per_step) * 1e-9,
                methods.c_str());
  std::cout << line;
  std::snprintf(line, sizeof line, "floor:      %.3f ms per step (bytes per step / copy bandwidth)\n", floor_s * 1e3);
  std::cout << line;
  std::snprintf(line, sizeof line, "step:       median %.3f ms, min %.3f ms (%d timed steps after %d warm-up)\n",
                med * 1e3, mn * 1e3, steps, warmup);
  std::cout << line;
  std::snprintf(line, sizeof line, "effective:  %.2f GB/s = %.1f%% of the copy-bandwidth floor\n", eff_bps * 1e-9,
                100.0 * floor_s / med);
  std::cout << line;
  std::snprintf(line, sizeof line, "setup:      %.2f s (compile or cache load, copy test, allocation and fill)\n",
                r.setup_s);
  std::cout << line << std::flush;

  if (o.flag("json")) {
    std::ostringstream j;
    j << "{\n  \"chain\": " << json_string(plan.program.chain_text) << ",\n  \"spec\": " << json_string(spec)
      << ",\n  \"workload\": " << json_string(w.name) << ",\n  \"scale\": " << json_number(scale)
      << ",\n  \"tensors\": " << w.tensors.size() << ",\n  \"elements\": " << elems
      << ",\n  \"dtype\": " << json_string(dtype_name(dtype)) << ",\n  \"backend\": " << json_string(backend_text)
      << ",\n  \"backend_status\": " << json_string(r.backend_status) << ",\n  \"device\": " << json_string(r.device)
      << ",\n  \"threads\": " << (backend == Backend::cpu ? default_thread_count() : 0)
      << ",\n  \"phases\": " << plan.phases.size() << ",\n  \"bytes_per_element\": " << per_elem
      << ",\n  \"bytes_per_step\": " << bytes_per_step
      << ",\n  \"copy_bandwidth_GBps\": " << json_number(r.copy_bps * 1e-9)
      << ",\n  \"copy_method\": " << json_string(r.copy_method) << ",\n  \"copy_methods_GBps\": {";
    for (size_t i = 0; i < r.copy_methods.size(); ++i)
      j << (i ? ", " : "") << json_string(r.copy_methods[i].first) << ": " << json_number(r.copy_methods[i].second * 1e-9);
    j << "}" << ",\n  \"floor_ms\": " << json_number(floor_s * 1e3)
      << ",\n  \"step_ms_median\": " << json_number(med * 1e3) << ",\n  \"step_ms_min\": " << json_number(mn * 1e3)
      << ",\n  \"effective_GBps\": " << json_number(eff_bps * 1e-9)
      << ",\n  \"fraction_of_floor\": " << json_number(floor_s / med) << ",\n  \"steps\": " << steps
      << ",\n  \"warmup\": " << warmup << ",\n  \"setup_s\": " << json_number(r.setup_s) << ",\n  \"step_ms\": [";
    for (size_t i = 0; i < r.step_s.size(); ++i) j << (i ? ", " : "") << json_number(r.step_s[i] * 1e3);
    j << "]\n}\n";
    std::ofstream f(o.get("json", ""));
    if (!f || !(f << j.str()) || !(f.flush())) throw Error("cannot write --json file '" + o.get("json", "") + "'");
  }
  return 0;
}

}  // namespace optfuse::cli
