#include "runtime/cuda_api.h"

#include <dlfcn.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <utility>

#include "runtime/disk_cache.h"
#include "runtime/sha256.h"

namespace optfuse::cuda {
namespace {

// Symbol tables. cuda.h #defines the plain names to the ABI versions a program built against this
// toolkit links to (cuMemAlloc -> cuMemAlloc_v2, cuEventElapsedTime -> cuEventElapsedTime_v2,
// cuGraphInstantiate -> cuGraphInstantiateWithFlags ...). Passing the plain name through a macro
// lets the preprocessor apply that mapping both to the member's type (decltype of the prototype:
// the versioned entry point's signature) and to the string handed to dlsym, so the right versioned
// symbol is resolved without a hand-kept table. Members carry the versioned name too, and every use
// goes through the same macros, so the names always agree.
#define OPTFUSE_STR2(x) #x
#define OPTFUSE_STR(x) OPTFUSE_STR2(x)

#define OPTFUSE_DRIVER_FUNCS(X)                                                                   \
  X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGetCount)       \
  X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetAttribute) X(cuDeviceTotalMem)                   \
  X(cuDevicePrimaryCtxRetain) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuCtxGetDevice)             \
  X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuFuncGetAttribute)              \
  X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocAsync)          \
  X(cuMemFreeAsync) X(cuMemcpyHtoDAsync)                                                          \
  X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async) X(cuPointerGetAttribute)           \
  X(cuStreamSynchronize) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamIsCapturing)              \
  X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuGraphInstantiate) X(cuGraphLaunch)            \
  X(cuGraphExecDestroy) X(cuGraphDestroy) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord)     \
  X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventQuery) X(cuStreamWaitEvent) X(cuMemHostAlloc)  \
  X(cuMemFreeHost)

#define OPTFUSE_NVRTC_FUNCS(X)                                                                    \
  X(nvrtcVersion) X(nvrtcGetErrorString) X(nvrtcGetNumSupportedArchs) X(nvrtcGetSupportedArchs)   \
  X(nvrtcCreateProgram) X(nvrtcDestroyProgram) X(nvrtcCompileProgram) X(nvrtcGetProgramLogSize)   \
  X(nvrtcGetProgramLog) X(nvrtcGetCUBINSize) X(nvrtcGetCUBIN)

#define OPTFUSE_DECLARE(fn) decltype(&::fn) fn = nullptr;
#define OPTFUSE_RESOLVE(fn) resolve(lib, OPTFUSE_STR(fn), a.fn, &missing);

struct DriverApi { OPTFUSE_DRIVER_FUNCS(OPTFUSE_DECLARE) };
struct NvrtcApi { OPTFUSE_NVRTC_FUNCS(OPTFUSE_DECLARE) };

template <class Api>
struct Loaded {
  Api api;
  bool ok = false;
  std::string why;     // reason when !ok
  std::string detail;  // NVRTC: its version, part of the cache key
};

// dlsym into a typed slot; the first missing name is kept for the message (an old driver/NVRTC).
template <class Fn>
void resolve(void* lib, const char* name, Fn& slot, std::string* missing) {
  slot = reinterpret_cast<Fn>(::dlsym(lib, name));
  if (!slot && missing->empty()) *missing = name;
}

// Libraries are never dlclose'd: objects destroyed during static destruction still call into them.
Loaded<DriverApi> load_driver() {
  Loaded<DriverApi> L;
  DriverApi& a = L.api;
  // Only the soname the driver package installs: the toolkit's link-time stubs/libcuda.so is never
  // picked up, and if a stub is found anyway, cuInit says so (CUDA_ERROR_STUB_LIBRARY) below.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    L.why = std::string("CUDA driver not found (dlopen libcuda.so.1: ") + (e ? e : "?") +
            "): is there an NVIDIA GPU and driver on this machine?";
    return L;
  }
  std::string missing;
  OPTFUSE_DRIVER_FUNCS(OPTFUSE_RESOLVE)
  int version = 0, count = 0;
  if (!missing.empty()) {
    if (a.cuDriverGetVersion) a.cuDriverGetVersion(&version);
    L.why = "CUDA driver too old: libcuda.so.1 (CUDA " + std::to_string(version / 1000) + "." +
            std::to_string(version % 1000 / 10) + ") lacks " + missing +
            "; optfuse needs a driver for CUDA 12.8 or newer";
  } else if (const CUresult r = a.cuInit(0); r != CUDA_SUCCESS) {
    const char *name = "?", *str = "?";
    a.cuGetErrorName(r, &name);
    a.cuGetErrorString(r, &str);
    L.why = std::string("CUDA driver failed to initialise (cuInit: ") + name + ": " + str + ")" +
            (r == CUDA_ERROR_STUB_LIBRARY ? ": the toolkit's stub libcuda was loaded, not a driver"
             : r == CUDA_ERROR_NO_DEVICE  ? ": no GPU is visible (check CUDA_VISIBLE_DEVICES)"
                                          : "");
  } else if (a.cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0) {
    L.why = "CUDA driver loaded but no CUDA device found";
  } else {
    L.ok = true;
  }
  return L;
}

Loaded<NvrtcApi> load_nvrtc() {
  Loaded<NvrtcApi> L;
  NvrtcApi& a = L.api;
  // The loader's search path first, then the toolkit's default location (often not on it).
  static const char* const kNames[] = {
      "libnvrtc.so.13", "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so.13",
      "/usr/local/cuda/lib64/libnvrtc.so", "/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.13",
      "/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so"};
  void* lib = nullptr;
  std::string errors, missing;
  for (const char* n : kNames) {
    if ((lib = ::dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    const char* e = ::dlerror();
    errors += std::string("\n  ") + (e ? e : n);
  }
  if (!lib) {
    L.why = "NVRTC not found (is the CUDA toolkit installed, or its lib64 on LD_LIBRARY_PATH?):" + errors;
    return L;
  }
  OPTFUSE_NVRTC_FUNCS(OPTFUSE_RESOLVE)
  int major = 0, minor = 0;
  if (!missing.empty() || a.nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) {
    L.why = "NVRTC library unusable: " + (missing.empty() ? "nvrtcVersion failed" : "it lacks " + missing);
    return L;
  }
  L.detail = std::to_string(major) + "." + std::to_string(minor);
  L.ok = true;
  return L;
}

// Function-local statics: loaded once, thread-safely, on first use; the outcome (and the reason for
// a failure) is kept, so later calls are cheap and give the same answer.
const Loaded<DriverApi>& driver_state() {
  static const Loaded<DriverApi> s = load_driver();
  return s;
}
const Loaded<NvrtcApi>& nvrtc_state() {
  static const Loaded<NvrtcApi> s = load_nvrtc();
  return s;
}
const DriverApi& drv() {
  if (!driver_state().ok) throw BackendUnavailable(driver_state().why);
  return driver_state().api;
}
const NvrtcApi& rtc() {
  if (!nvrtc_state().ok) throw BackendUnavailable(nvrtc_state().why);
  return nvrtc_state().api;
}

std::string cu_error_text(CUresult r) {
  const char *name = nullptr, *str = nullptr;
  const auto& d = driver_state().api;
  if (d.cuGetErrorName) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString) d.cuGetErrorString(r, &str);
  return (name ? name : "CUresult " + std::to_string(static_cast<int>(r))) +
         (str ? std::string(": ") + str : std::string());
}
void cu_check(CUresult r, const char* fn, const std::string& context = {}) {
  if (r != CUDA_SUCCESS)
    throw Error(std::string("CUDA error in ") + fn + (context.empty() ? "" : " (" + context + ")") +
                ": " + cu_error_text(r));
}
void rtc_check(nvrtcResult r, const char* fn) {
  if (r == NVRTC_SUCCESS) return;
  const char* s = rtc().nvrtcGetErrorString(r);
  throw Error(std::string("NVRTC error in ") + fn + ": " + (s ? s : "unknown"));
}

// CU(fn, args...) calls the loaded entry point for fn and checks the result; messages name fn as
// written here (e.g. "cuMemAlloc"), not the versioned symbol. CU_CTX adds a context string.
#define CU(fn, ...) cu_check(drv().fn(__VA_ARGS__), #fn)
// ctx (a string saying what the call was for) is evaluated only when the call failed: launches and
// uploads run every step, and building their message each time was host time for nothing.
#define CU_CTX(ctx, fn, ...)                                    \
  do {                                                          \
    const CUresult cu_result_ = drv().fn(__VA_ARGS__);          \
    if (cu_result_ != CUDA_SUCCESS) cu_check(cu_result_, #fn, ctx); \
  } while (0)
#define RTC(fn, ...) rtc_check(rtc().fn(__VA_ARGS__), #fn)

// The primary context (the one the CUDA runtime uses too) is retained once per process and never
// released: releasing it at static destruction would race with buffers and modules still alive.
CUcontext primary_context() {
  static std::mutex mu;
  static CUcontext ctx = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (ctx) return ctx;
  int ordinal = 0, count = 0;
  if (const char* e = std::getenv("OPTFUSE_CUDA_DEVICE"); e && *e) {
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (*end != '\0' || v < 0 || v > 1 << 20)
      throw Error(std::string("OPTFUSE_CUDA_DEVICE='") + e + "' is not a device ordinal");
    ordinal = static_cast<int>(v);
  }
  CU(cuDeviceGetCount, &count);
  if (ordinal >= count)
    throw BackendUnavailable("OPTFUSE_CUDA_DEVICE=" + std::to_string(ordinal) + " but only " +
                             std::to_string(count) + " CUDA device(s) are visible");
  CUdevice dev = 0;
  CU(cuDeviceGet, &dev, ordinal);
  CU(cuDevicePrimaryCtxRetain, &ctx, dev);
  return ctx;
}

// Context currency is per thread: a thread's first call makes the primary context current on it.
void ensure_context() {
  CUcontext cur = nullptr;
  CU(cuCtxGetCurrent, &cur);
  if (!cur) CU(cuCtxSetCurrent, primary_context());
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

}  // namespace

bool driver_available(std::string* why) {
  if (!driver_state().ok && why) *why = driver_state().why;
  return driver_state().ok;
}

bool nvrtc_available(std::string* why) {
  if (!nvrtc_state().ok && why) *why = nvrtc_state().why;
  return nvrtc_state().ok;
}

Device current_device() {
  ensure_context();
  CUdevice dev = 0;
  CU(cuCtxGetDevice, &dev);
  Device d;  // a handful of cheap driver queries, no GPU round trip: not worth caching
  d.ordinal = static_cast<int>(dev);  // CUdevice handles are the ordinals cuDeviceGet was given
  CU(cuDeviceGetAttribute, &d.cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  CU(cuDeviceGetAttribute, &d.cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  CU(cuDeviceGetAttribute, &d.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  char name[256] = {};
  CU(cuDeviceGetName, name, static_cast<int>(sizeof name - 1), dev);
  d.name = name;
  CU(cuDeviceTotalMem, &d.total_mem, dev);
  return d;
}

namespace {
std::string numbered_head(const std::string& source, int max_lines) {
  std::istringstream in(source);
  std::string out, line;
  char num[16];
  for (int n = 1; n <= max_lines && std::getline(in, line); ++n) {
    std::snprintf(num, sizeof num, "%5d | ", n);
    out += num + line + '\n';
  }
  return out;
}

bool looks_like_elf(const std::string& b) {
  return b.size() >= 64 && std::memcmp(b.data(), "\x7f" "ELF", 4) == 0;
}
}  // namespace

CompileResult compile(const std::string& source, const std::string& program_name, int arch,
                      const std::vector<std::string>& extra_options) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (const auto& o : extra_options)
    for (const char* bad : {"use_fast_math", "prec-div=false", "prec-sqrt=false", "prec_div=false",
                            "prec_sqrt=false"})
      if (o.find(bad) != std::string::npos)
        throw Error("compile(" + program_name + "): option '" + o +
                    "' is not allowed: optfuse kernels need IEEE-rounded division and square root");
  const auto& api = rtc();  // throws BackendUnavailable without NVRTC
  std::vector<std::string> opts = {"-std=c++17", "--gpu-architecture=sm_" + std::to_string(arch),
                                   "-default-device"};
  opts.insert(opts.end(), extra_options.begin(), extra_options.end());
  // Cache key: the SHA-256 of everything that determines the CUBIN (see disk_cache.h for what is
  // checked before an entry is used: the bytes handed to the driver are the ones verified).
  std::string key_text = "optfuse-cuda-v2\nnvrtc " + nvrtc_state().detail + "\n";
  for (const auto& o : opts) key_text += std::to_string(o.size()) + ":" + o + "\n";
  key_text += "--\n";
  Sha256 key_hash;  // of key_text + source, without copying the source
  key_hash.update(key_text);
  key_hash.update(source);
  const std::string key = to_hex(key_hash.finish());
  const bool use_cache = !env_flag("OPTFUSE_NO_CACHE");
  std::optional<DiskCache> cache;
  DiskCache::Lock file_lock;
  if (use_cache) {
    cache.emplace("cuda");  // unusable (with one warning) if the directory cannot be trusted
    auto hit = [&]() -> std::optional<std::string> {
      auto e = cache->load(key, ".cubin", true);
      if (e && looks_like_elf(e->payload)) return std::move(e->payload);
      return std::nullopt;
    };
    if (auto h = hit()) return CompileResult{std::move(*h), {}, elapsed(), true};
    file_lock = cache->lock(key);  // one NVRTC compile per key across processes
    if (auto h = hit()) return CompileResult{std::move(*h), {}, elapsed(), true};
    cache->remove_stale();
  }
  // Reject an unknown architecture up front: NVRTC's own message ("invalid value for
  // --gpu-architecture") does not say which ones it supports.
  int n_archs = 0;
  RTC(nvrtcGetNumSupportedArchs, &n_archs);
  std::vector<int> archs(static_cast<size_t>(std::max(n_archs, 0)) + 1);
  RTC(nvrtcGetSupportedArchs, archs.data());
  archs.pop_back();
  std::string list;
  for (int a : archs) list += " " + std::to_string(a);
  if (std::find(archs.begin(), archs.end(), arch) == archs.end())
    throw Error("compile(" + program_name + "): NVRTC " + nvrtc_state().detail +
                " cannot generate code for sm_" + std::to_string(arch) + " (supported:" + list + ")");
  nvrtcProgram prog = nullptr;
  RTC(nvrtcCreateProgram, &prog, source.c_str(), program_name.c_str(), 0, nullptr, nullptr);
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> destroy(  // on every way out
      &prog, [](nvrtcProgram* p) { nvrtc_state().api.nvrtcDestroyProgram(p); });
  std::vector<const char*> cargs;
  std::string optline;
  for (const auto& o : opts) cargs.push_back(o.c_str()), optline += " " + o;
  const nvrtcResult cr = api.nvrtcCompileProgram(prog, static_cast<int>(cargs.size()), cargs.data());
  size_t log_size = 0;
  std::string log;
  if (api.nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    if (api.nvrtcGetProgramLog(prog, &log[0]) != NVRTC_SUCCESS) log.clear();
    while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  }
  if (cr != NVRTC_SUCCESS) {
    const char* es = api.nvrtcGetErrorString(cr);
    throw Error("NVRTC failed to compile '" + program_name + "' for sm_" + std::to_string(arch) +
                " (" + (es ? es : "?") + "):\n" + log + "\noptions:" + optline +
                "\nsource (first 40 lines):\n" + numbered_head(source, 40));
  }
  size_t cubin_size = 0;
  RTC(nvrtcGetCUBINSize, prog, &cubin_size);
  std::string cubin(cubin_size, '\0');
  if (cubin_size) RTC(nvrtcGetCUBIN, prog, &cubin[0]);
  if (!looks_like_elf(cubin))
    throw Error("NVRTC produced no CUBIN for '" + program_name + "' (sm_" + std::to_string(arch) +
                "); was a virtual architecture requested?");
  if (cache) cache->store(key, ".cubin", cubin);  // best effort: a read-only or full cache is no error
  return CompileResult{std::move(cubin), std::move(log), elapsed(), false};
}

// Kernel resources from the CUBIN's ELF as CUDA 12/13 write it (checked with ptxas -v, sm_75..120):
// `.nv.info` holds per kernel symbol index EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11);
// `.nv.info.<kernel>` the launch bounds EIATTR_MAX_THREADS (0x05) / EIATTR_REQNTID (0x10). Static
// shared memory is the size of NOBITS `.nv.shared.<kernel>` less the reserved window at its start
// from sm_90 on (where `.nv.shared.reserved.0` exists: 1 KiB, or `.nv.reservedSmem.cap` if present),
// which CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES leaves out too. Records are {u8 format, u8 attribute,
// payload} on a 4-byte grid: format 4 (SVAL) has a u16 length and that many bytes, formats 1-3 are
// 4 bytes in all. On an H200 (driver 580) all four numbers matched cuFuncGetAttribute (see tests).
namespace {
template <class T>
bool read_at(const std::string& b, uint64_t off, T* out) {
  if (off > b.size() || b.size() - off < sizeof(T)) return false;
  std::memcpy(out, b.data() + off, sizeof(T));
  return true;
}

struct Section {
  std::string name;
  uint32_t name_off = 0, type = 0, link = 0;
  uint64_t offset = 0, size = 0;
};

// Calls f(attribute, payload words) for each SVAL record; false on a stream it cannot walk.
template <class F>
bool for_each_attr(const std::string& b, const Section& s, F f) {
  if (s.offset > b.size() || s.size > b.size() - s.offset) return false;
  for (uint64_t p = s.offset, end = s.offset + s.size; p + 4 <= end;) {
    const uint8_t fmt = static_cast<uint8_t>(b[p]), attr = static_cast<uint8_t>(b[p + 1]);
    uint16_t len = 0;
    if (fmt < 1 || fmt > 4 || (fmt == 4 && (!read_at(b, p + 2, &len) || p + 4 + len > end)))
      return false;
    if (fmt == 4) {
      std::vector<uint32_t> w(len / 4);
      std::memcpy(w.data(), b.data() + p + 4, w.size() * 4);
      f(attr, w);
    }
    p += 4 + ((len + 3u) & ~3u);
  }
  return true;
}

// Largest block the driver accepts with `regs` registers per thread (sm_50..sm_12x): registers go
// to warps in units of 256, at most 64K per block, and the launch check assumes the warps spread
// evenly over the 4 SM sub-partitions (cudaOccMaxBlocksPerSMRegsLimit in cuda_occupancy.h).
int max_threads_for_regs(int regs) {
  if (regs <= 0) return 1024;
  const int per_warp = (regs * 32 + 255) / 256 * 256;
  return std::min(1024, 4 * (16384 / per_warp) * 32);
}
}  // namespace

std::optional<KernelResources> resources_from_cubin(const std::string& b,
                                                    const std::string& kernel_name) {
  // ELF64, little-endian, e_machine EM_CUDA (190).
  uint16_t machine = 0, shentsize = 0, shnum = 0, shstrndx = 0;
  uint64_t shoff = 0;
  if (!looks_like_elf(b) || b[4] != 2 || b[5] != 1 || !read_at(b, 0x12, &machine) ||
      machine != 190 || !read_at(b, 0x28, &shoff) || !read_at(b, 0x3a, &shentsize) ||
      !read_at(b, 0x3c, &shnum) || !read_at(b, 0x3e, &shstrndx) || shentsize < 64 ||
      shstrndx >= shnum)
    throw Error("resources_from_cubin: not a CUDA ELF (cubin) image");
  std::vector<Section> secs(shnum);
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint64_t h = shoff + uint64_t(i) * shentsize;
    if (!read_at(b, h, &secs[i].name_off) || !read_at(b, h + 4, &secs[i].type) ||
        !read_at(b, h + 0x18, &secs[i].offset) || !read_at(b, h + 0x20, &secs[i].size) ||
        !read_at(b, h + 0x28, &secs[i].link))
      throw Error("resources_from_cubin: truncated section headers");
  }
  auto cstr = [&](uint64_t off) {
    return off >= b.size() ? std::string()
                           : std::string(b.data() + off, strnlen(b.data() + off, b.size() - off));
  };
  for (Section& s : secs) s.name = cstr(secs[shstrndx].offset + s.name_off);
  int64_t sym_index = -1;     // the kernel's symbol index, which .nv.info records refer to
  uint64_t reserved_cap = 0;  // value of .nv.reservedSmem.cap, where the cubin has it
  std::string kernels;
  for (const Section& s : secs) {
    if (s.type != 2 /*SHT_SYMTAB*/ || s.link >= secs.size()) continue;
    for (uint64_t k = 0; k * 24 + 24 <= s.size; ++k) {  // Elf64_Sym: name u32, info u8, value u64@8
      const uint64_t e = s.offset + k * 24;
      uint32_t nm = 0;
      uint8_t info = 0;
      if (!read_at(b, e, &nm) || !read_at(b, e + 4, &info)) break;
      const std::string name = cstr(secs[s.link].offset + nm);
      if (name == ".nv.reservedSmem.cap") read_at(b, e + 8, &reserved_cap);
      if ((info & 0xf) != 2 /*STT_FUNC*/) continue;
      if (name == kernel_name) sym_index = static_cast<int64_t>(k);
      kernels += (kernels.empty() ? "" : ", ") + name;
    }
  }
  if (sym_index < 0)
    throw Error("resources_from_cubin: no kernel '" + kernel_name + "' in the cubin (functions: " +
                kernels + ")");
  KernelResources r;
  bool have_regs = false, reserved_window = false;
  uint64_t shared_section = 0;
  int bound = 1024;
  for (const Section& s : secs) {
    if (s.name == ".nv.shared." + kernel_name) shared_section = s.size;
    if (s.name == ".nv.shared.reserved.0") reserved_window = true;
    const bool global = s.name == ".nv.info", mine = s.name == ".nv.info." + kernel_name;
    if ((global || mine) && !for_each_attr(b, s, [&](int attr, const std::vector<uint32_t>& w) {
          if (global && w.size() >= 2 && w[0] == sym_index && attr == 0x2f /*REGCOUNT*/)
            r.registers = static_cast<int>(w[1]), have_regs = true;
          if (global && w.size() >= 2 && w[0] == sym_index && attr == 0x11 /*FRAME_SIZE*/)
            r.local_bytes = static_cast<int>(w[1]);
          if (mine && (attr == 0x05 /*MAX_THREADS*/ || attr == 0x10 /*REQNTID*/) && w.size() >= 3) {
            const uint64_t t = uint64_t(std::max(w[0], 1u)) * std::max(w[1], 1u) * std::max(w[2], 1u);
            bound = static_cast<int>(std::min<uint64_t>(t, uint64_t(bound)));
          }
        }))
      return std::nullopt;  // a record format this parser does not know: do not guess
  }
  if (!have_regs) return std::nullopt;
  const uint64_t reserved = reserved_window ? (reserved_cap ? reserved_cap : 1024) : 0;
  r.shared_bytes = static_cast<int>(shared_section > reserved ? shared_section - reserved : 0);
  r.max_threads_per_block = std::min(bound, max_threads_for_regs(r.registers));
  return r;
}

// RAII handles. Deleters ignore errors: they must not throw, and at process exit the driver may
// already be shutting down.
namespace detail {
#define OPTFUSE_DELETER(Cls, T, fn) \
  void Cls::operator()(T h) const noexcept { driver_state().api.fn(h); }
OPTFUSE_DELETER(ModuleUnload, CUmodule, cuModuleUnload)
OPTFUSE_DELETER(StreamDestroy, CUstream, cuStreamDestroy)
OPTFUSE_DELETER(GraphDestroy, CUgraph, cuGraphDestroy)
OPTFUSE_DELETER(GraphExecDestroy, CUgraphExec, cuGraphExecDestroy)
OPTFUSE_DELETER(EventDestroy, CUevent, cuEventDestroy)
OPTFUSE_DELETER(HostFree, void*, cuMemFreeHost)
}  // namespace detail

Module::Module(const std::string& cubin) {
  if (cubin.empty()) throw Error("Module: empty cubin");
  ensure_context();
  CUmodule m = nullptr;
  const CUresult r = drv().cuModuleLoadData(&m, cubin.data());
  if (r == CUDA_ERROR_NO_BINARY_FOR_GPU || r == CUDA_ERROR_INVALID_IMAGE) {
    const Device d = current_device();
    cu_check(r, "cuModuleLoadData", "the device is sm_" + std::to_string(d.arch()) + ", " + d.name +
                                        ": compile for it, e.g. compile(..., current_device().arch())");
  }
  cu_check(r, "cuModuleLoadData");
  mod_.reset(m);
}
std::shared_ptr<const Module> shared_module(const std::string& cubin) {
  ensure_context();
  CUcontext ctx = nullptr;
  CU(cuCtxGetCurrent, &ctx);
  // Never destroyed: unloading at exit, after the context may be gone, would gain nothing.
  static auto* loaded = new std::map<std::pair<CUcontext, std::string>, std::shared_ptr<const Module>>();
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  auto key = std::make_pair(ctx, cubin);
  auto it = loaded->find(key);
  if (it == loaded->end()) it = loaded->emplace(std::move(key), std::make_shared<const Module>(cubin)).first;
  return it->second;
}
CUfunction Module::function(const std::string& name) const {
  CUfunction f = nullptr;
  CU_CTX("kernel '" + name + "'", cuModuleGetFunction, &f, mod_.get(), name.c_str());
  return f;
}
KernelResources Module::resources(const std::string& name) const {
  CUfunction f = function(name);
  KernelResources r;
  CU(cuFuncGetAttribute, &r.registers, CU_FUNC_ATTRIBUTE_NUM_REGS, f);
  CU(cuFuncGetAttribute, &r.local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f);
  CU(cuFuncGetAttribute, &r.shared_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f);
  CU(cuFuncGetAttribute, &r.max_threads_per_block, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f);
  return r;
}
static bool capturing(CUstream stream) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  CU(cuStreamIsCapturing, stream, &st);
  return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

void launch(CUfunction f, unsigned grid, unsigned block, size_t shared_bytes, CUstream stream,
            void** args) {
  if (!f) throw Error("launch: null CUfunction");
  auto shape = [&] {
    return "grid=" + std::to_string(grid) + " block=" + std::to_string(block) + " shared=" + std::to_string(shared_bytes);
  };
  if (grid == 0 || block == 0) throw Error("launch: empty launch (" + shape() + ")");
  ensure_context();
  // Above 48 KiB of dynamic shared memory a kernel must opt in; setting the attribute is cheap and
  // idempotent, and the launch itself still fails cleanly if the device has less.
  if (shared_bytes > 48 * 1024)
    CU_CTX(shape(), cuFuncSetAttribute, f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
           static_cast<int>(shared_bytes));
  CU_CTX(shape(), cuLaunchKernel, f, grid, 1, 1, block, 1, 1, static_cast<unsigned>(shared_bytes),
         stream, args, nullptr);
  static const bool blocking = env_flag("OPTFUSE_CUDA_LAUNCH_BLOCKING");  // read once, as CUDA's own
  if (blocking && !capturing(stream))
    CU_CTX("after kernel launch, " + shape(), cuStreamSynchronize, stream);
}

// Whether the current device allocates stream-ordered (memory pools; not OPTFUSE_CUDA_PLAIN_ALLOC=1).
static bool stream_ordered_memory() {
  ensure_context();
  CUdevice dev = 0;
  CU(cuCtxGetDevice, &dev);
  static const bool plain = env_flag("OPTFUSE_CUDA_PLAIN_ALLOC");  // read once, as the launch flag
  static std::map<CUdevice, bool> pools;                            // asked once per device
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  auto it = pools.find(dev);
  if (it == pools.end()) {
    int supported = 0;
    CU(cuDeviceGetAttribute, &supported, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev);
    it = pools.emplace(dev, supported != 0).first;
  }
  return it->second && !plain;
}
DeviceBuffer::DeviceBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemAlloc, &ptr_, bytes);
}
DeviceBuffer DeviceBuffer::ordered(size_t bytes, CUstream stream) {
  // (On a stream being captured a stream-ordered allocation would become the graph's own memory.)
  if (bytes == 0 || !stream_ordered_memory() || capturing(stream)) return DeviceBuffer(bytes);
  DeviceBuffer b;
  CU_CTX(std::to_string(bytes) + " bytes", cuMemAllocAsync, &b.ptr_, bytes, stream);
  b.size_ = bytes;
  b.stream_ = stream;
  b.ordered_ = true;
  return b;
}
DeviceBuffer::~DeviceBuffer() {
  if (!ptr_) return;
  if (ordered_) driver_state().api.cuMemFreeAsync(ptr_, stream_);
  else driver_state().api.cuMemFree(ptr_);
}
void copy_to_device(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemcpyHtoDAsync, dst, src, bytes, stream);
  // From pageable memory the driver has copied src into a staging buffer before returning. From
  // page-locked memory the DMA reads src later, so wait for it to keep "src reusable on return".
  // (The query fails with CUDA_ERROR_INVALID_VALUE for ordinary pageable memory; that is expected.)
  unsigned int type = 0;
  if (drv().cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                  reinterpret_cast<CUdeviceptr>(src)) == CUDA_SUCCESS &&
      type == CU_MEMORYTYPE_HOST && !capturing(stream))
    CU(cuStreamSynchronize, stream);
}
void copy_to_host(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemcpyDtoHAsync, dst, src, bytes, stream);
  CU(cuStreamSynchronize, stream);
}
void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemcpyDtoDAsync, dst, src, bytes, stream);
}
void memset_zero(CUdeviceptr dst, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemsetD8Async, dst, 0, bytes, stream);
}
void stream_synchronize(CUstream stream) {
  ensure_context();
  CU(cuStreamSynchronize, stream);
}

Stream::Stream() {
  ensure_context();
  CUstream s = nullptr;
  CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
  s_.reset(s);
}
void begin_capture(CUstream stream) {
  if (!stream) throw Error("begin_capture: the legacy default stream cannot be captured; use a Stream");
  ensure_context();
  CU(cuStreamBeginCapture, stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}
Graph end_capture(CUstream stream) {
  ensure_context();
  Graph g;
  CUgraph graph = nullptr;
  const CUresult r = drv().cuStreamEndCapture(stream, &graph);
  g.graph_.reset(graph);  // an invalidated capture may still hand back a graph: freed with g
  cu_check(r, "cuStreamEndCapture",
           r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
               ? "the capture was invalidated by an operation not allowed while capturing"
               : "");
  if (!graph) throw Error("end_capture: capture produced no graph");
  CUgraphExec exec = nullptr;
  CU(cuGraphInstantiate, &exec, graph, 0);
  g.exec_.reset(exec);
  return g;
}
void Graph::launch(CUstream stream) const {
  if (!exec_) throw Error("Graph::launch: empty graph");
  ensure_context();
  CU(cuGraphLaunch, exec_.get(), stream);
}

bool stream_is_capturing(CUstream stream) {
  ensure_context();
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  CU(cuStreamIsCapturing, stream, &st);
  return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

PinnedBuffer::PinnedBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  ensure_context();
  void* p = nullptr;
  CU_CTX(std::to_string(bytes) + " bytes of page-locked host memory", cuMemHostAlloc, &p, bytes, 0u);
  p_.reset(p);
}

Event::Event() {
  ensure_context();
  CUevent e = nullptr;
  CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
  e_.reset(e);
}
void Event::record(CUstream stream) { CU(cuEventRecord, e_.get(), stream); }
bool Event::done() const {
  const CUresult r = drv().cuEventQuery(e_.get());
  if (r == CUDA_ERROR_NOT_READY) return false;
  cu_check(r, "cuEventQuery");
  return true;
}
void Event::wait() const { CU(cuEventSynchronize, e_.get()); }
void Event::make_wait(CUstream stream) const { CU(cuStreamWaitEvent, stream, e_.get(), 0u); }

void copy_pinned_to_device_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  if (bytes == 0) return;
  ensure_context();
  CU_CTX(std::to_string(bytes) + " bytes", cuMemcpyHtoDAsync, dst, src, bytes, stream);
}

EventTimer::EventTimer() {
  ensure_context();
  for (auto* ev : {&start_, &stop_}) {
    CUevent e = nullptr;
    CU(cuEventCreate, &e, CU_EVENT_DEFAULT);
    ev->reset(e);
  }
}
void EventTimer::start(CUstream stream) { CU(cuEventRecord, start_.get(), stream); }
void EventTimer::stop(CUstream stream) { CU(cuEventRecord, stop_.get(), stream); }
float EventTimer::elapsed_ms() const {
  CU(cuEventSynchronize, stop_.get());
  float ms = 0;
  CU(cuEventElapsedTime, &ms, start_.get(), stop_.get());
  return ms;
}
}  // namespace optfuse::cuda
