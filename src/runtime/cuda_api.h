// CUDA run-time layer: the CUDA driver (libcuda.so.1) and NVRTC are loaded with dlopen at run time,
// so optfuse builds and runs on machines without a GPU (NVRTC-only machines can still compile
// kernels to CUBIN). Nothing here links against libcuda or libnvrtc; <cuda.h> is included only for
// its types (CUfunction, CUstream, CUdeviceptr...).
//
// Errors: a missing library, a driver that cannot initialise or no device -> BackendUnavailable
// (message says what was missing); any other failing CUDA/NVRTC call -> optfuse::Error naming the
// function and the CUDA error string.
//
// Contexts: every call that needs a context uses the one current on the calling thread; if there is
// none, the primary context of device $OPTFUSE_CUDA_DEVICE (default 0) is made current (it is the
// same context the CUDA runtime uses, so memory and streams interoperate with it).
#pragma once
#include <cuda.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "optfuse/error.h"

namespace optfuse::cuda {

namespace detail {  // deleters for the RAII handles below (defined in cuda_api.cpp; never throw)
struct ModuleUnload { void operator()(CUmodule m) const noexcept; };
struct StreamDestroy { void operator()(CUstream s) const noexcept; };
struct GraphDestroy { void operator()(CUgraph g) const noexcept; };
struct GraphExecDestroy { void operator()(CUgraphExec g) const noexcept; };
struct EventDestroy { void operator()(CUevent e) const noexcept; };
struct HostFree { void operator()(void* p) const noexcept; };
}  // namespace detail

// True when libcuda.so.1 loads, cuInit succeeds and at least one device exists. Never throws;
// on false, *why (if given) says what is missing.
bool driver_available(std::string* why = nullptr);
// True when an NVRTC library loads (compiling needs no GPU). Never throws.
bool nvrtc_available(std::string* why = nullptr);

struct Device {
  int ordinal = 0;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  std::string name;
  size_t total_mem = 0;
  int arch() const { return cc_major * 10 + cc_minor; }  // e.g. 90 for sm_90
};
// Device of the calling thread's current context; makes the primary context of device 0 (or
// $OPTFUSE_CUDA_DEVICE) current first if no context is. Thread-safe.
Device current_device();

struct CompileResult {
  std::string cubin;  // ELF image for cuModuleLoadData
  std::string log;    // NVRTC log (warnings); empty on a cache hit
  double seconds = 0; // wall time of this call (compile or cache load)
  bool from_cache = false;
};
// Compiles CUDA C++ with NVRTC for sm_<arch> into a CUBIN; needs no GPU. Options are always
// -std=c++17 --gpu-architecture=sm_<arch> -default-device, then extra_options. Fast-math options
// (--use_fast_math, --prec-div=false, --prec-sqrt=false) are refused: kernels need IEEE sqrt/div.
// Results are cached (DiskCache("cuda"), keyed on the SHA-256 of source, arch, NVRTC version and
// options; an entry is verified against its recorded SHA-256 before use, one compile per key across
// processes) unless OPTFUSE_NO_CACHE=1; a hit does not invoke the compiler. A compile error throws optfuse::Error with
// the NVRTC log and the first 40 source lines, numbered.
CompileResult compile(const std::string& source, const std::string& program_name, int arch,
                      const std::vector<std::string>& extra_options = {});

struct KernelResources {
  int registers = 0;              // per thread
  int local_bytes = 0;            // per-thread local memory (stack frame, spills)
  int shared_bytes = 0;           // static shared memory per block
  int max_threads_per_block = 0;  // largest block the kernel can be launched with
};
// Resources of `kernel_name` (the symbol name: extern "C" name or mangled name), read from the
// cubin's ELF .nv.info sections without a GPU. max_threads_per_block is derived from the register
// count and launch bounds the way the driver does it for sm_50..sm_12x (64K registers per block,
// 256-register warp allocation unit, 4 SM sub-partitions). Returns nullopt when the cubin carries no
// register count for the kernel (an ELF layout this parser does not know); throws Error when the
// bytes are not a CUDA ELF or the kernel is not in it. Module::resources asks the driver instead.
std::optional<KernelResources> resources_from_cubin(const std::string& cubin,
                                                    const std::string& kernel_name);

// A loaded cubin (cuModuleLoadData); unloaded on destruction. Movable, not copyable.
class Module {
 public:
  explicit Module(const std::string& cubin);

  CUfunction function(const std::string& name) const;  // throws Error if absent
  KernelResources resources(const std::string& name) const;  // cuFuncGetAttribute
  CUmodule get() const { return mod_.get(); }

 private:
  std::unique_ptr<std::remove_pointer_t<CUmodule>, detail::ModuleUnload> mod_;
};

// The module of `cubin` in the current context, loaded once and kept for the process's lifetime:
// a new optimizer whose kernels another one already loaded loads nothing, and destroying an
// optimizer unloads nothing (kernels it queued may still run, and cuModuleUnload would have to
// wait for them). Distinct cubins are few: one per chain structure and storage-variant set.
std::shared_ptr<const Module> shared_module(const std::string& cubin);

// 1-D launch of f with args (array of pointers to each argument, as cuLaunchKernel wants). Checks
// grid/block are non-zero, opts in to more than 48 KiB of dynamic shared memory when asked for, and
// checks the launch's return code. With OPTFUSE_CUDA_LAUNCH_BLOCKING=1 it also synchronises the
// stream (outside graph capture) so asynchronous kernel faults surface at the launch that caused them.
void launch(CUfunction f, unsigned grid, unsigned block, size_t shared_bytes, CUstream stream,
            void** args);

// Device memory, freed on destruction. Movable, not copyable. A zero-byte buffer holds no
// allocation (ptr() == 0). DeviceBuffer(bytes): cuMemAlloc / cuMemFree, usable on any stream.
// DeviceBuffer::ordered(bytes, stream): where the device has memory pools,
// the allocation and the free are stream-ordered (cuMemAllocAsync / cuMemFreeAsync): neither makes
// the host wait, whereas cuMemFree waits for all work queued on the device, so a rebuild, a retired
// table or a destroyed optimizer would stall a training loop whose GPU is busy. Such a buffer is
// used on its stream (or on streams ordered after it), and its free is queued on the stream set by
// free_on (the one of its last use), after everything queued there before it. Without memory pools,
// on a stream being captured, or with OPTFUSE_CUDA_PLAIN_ALLOC=1, it is a plain buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  static DeviceBuffer ordered(size_t bytes, CUstream stream);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    DeviceBuffer old(std::move(o));  // the previous allocation is freed with `old`, at once
    swap(old);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  CUdeviceptr ptr() const { return ptr_; }
  size_t size() const { return size_; }
  void free_on(CUstream stream) { stream_ = stream; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    std::swap(stream_, o.stream_);
    std::swap(ordered_, o.ordered_);
  }
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
  CUstream stream_ = nullptr;  // the free is queued here (stream-ordered buffers)
  bool ordered_ = false;       // allocated by cuMemAllocAsync
};

// Host -> device, ordered on `stream`. Returns once `src` may be reused or freed: for pageable host
// memory the driver has staged it by then; for page-locked memory this call synchronises the stream.
void copy_to_device(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
// Device -> host, ordered on `stream`; synchronises the stream, so `dst` holds the data on return.
void copy_to_host(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
// Device -> device (cuMemcpyDtoDAsync), ordered on `stream`; asynchronous (no synchronisation).
void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
void memset_zero(CUdeviceptr dst, size_t bytes, CUstream stream);
void stream_synchronize(CUstream stream);

// A non-blocking stream (CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream).
class Stream {  // movable, not copyable
 public:
  Stream();
  CUstream get() const { return s_.get(); }
  void synchronize() const { stream_synchronize(get()); }

 private:
  std::unique_ptr<std::remove_pointer_t<CUstream>, detail::StreamDestroy> s_;
};

// Stream capture into an instantiated graph. Capture needs a stream other than the legacy default
// stream (use Stream). Mode is thread-local: other threads may keep using CUDA meanwhile.
//   begin_capture(s); launch(..., s, ...); Graph g = end_capture(s); g.launch(s);
void begin_capture(CUstream stream);

class Graph {  // movable, not copyable
 public:
  void launch(CUstream stream) const;  // replays the whole captured work on `stream`
  bool empty() const { return exec_ == nullptr; }

 private:
  friend Graph end_capture(CUstream stream);
  // Declared in this order so the executable graph is destroyed before the graph it came from.
  std::unique_ptr<std::remove_pointer_t<CUgraph>, detail::GraphDestroy> graph_;
  std::unique_ptr<std::remove_pointer_t<CUgraphExec>, detail::GraphExecDestroy> exec_;
};
// Ends the capture begun on `stream` and instantiates it. Throws Error if the capture was
// invalidated (e.g. a synchronising call was made on the stream while capturing).
Graph end_capture(CUstream stream);

// True while `stream` is being captured into a CUDA graph (work queued on it then runs only when the
// graph is launched).
bool stream_is_capturing(CUstream stream);

// Page-locked host memory (cuMemHostAlloc): the source of asynchronous uploads. Movable.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(std::move(o.p_)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    p_ = std::move(o.p_);
    size_ = std::exchange(o.size_, 0);
    return *this;
  }
  void* data() const { return p_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<void, detail::HostFree> p_;
  size_t size_ = 0;
};

// A synchronisation-only event (no timing). Movable.
class Event {
 public:
  Event();
  void record(CUstream stream);
  bool done() const;                     // cuEventQuery: has the recorded work finished?
  void wait() const;                     // the host waits for it
  void make_wait(CUstream stream) const; // `stream` waits for it, on the device (no host wait)

 private:
  std::unique_ptr<std::remove_pointer_t<CUevent>, detail::EventDestroy> e_;
};

// Host -> device from page-locked memory, fully asynchronous: `src` must stay unchanged until the
// copy has run (record an Event after it). Captured into a graph when `stream` is capturing.
void copy_pinned_to_device_async(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);

// GPU-side timing with two events: start(s) ... stop(s); elapsed_ms() waits for the stop event.
class EventTimer {  // movable, not copyable
 public:
  EventTimer();
  void start(CUstream stream);
  void stop(CUstream stream);
  float elapsed_ms() const;

 private:
  std::unique_ptr<std::remove_pointer_t<CUevent>, detail::EventDestroy> start_, stop_;
};

}  // namespace optfuse::cuda
