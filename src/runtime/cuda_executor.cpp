// The CUDA backend: the plan's generated CUDA (codegen/cuda_source.cpp) compiled once by NVRTC for
// the current device (cached on disk by content), a device-resident scalar table, and per step two
// launches per phase (scalar kernel, element kernel) on the caller's stream.
//
// A step allocates nothing, copies nothing and never waits for the device: grad_scale and found_inf
// are read on the device, and skip decisions and step counts stay there. So a step can be captured
// in a CUDA graph and replayed; hyperparameters written between replays (set_hyper) land in the same
// table and are seen by the next replay, with no recompile. The source holds no shapes, group count
// or hyperparameter values, so the NVRTC cache has one entry per chain structure and device arch.
//
// Host-side writes (hyperparameters, step counts, new pointers) are ordered on the stream of the
// last step; before the first step, and for setup calls (set_tensors, resize_groups), they are
// waited for. A caller that changes streams between steps must order them itself.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "codegen/cuda_source.h"
#include "optfuse/error.h"
#include "runtime/chunks.h"
#include "runtime/cuda_api.h"
#include "runtime/executor.h"
#include "runtime/tensor_table.h"

namespace optfuse {

namespace {

// Elements per chunk. One chunk is the unit of work of one block, so it must be small enough that a
// single huge tensor gives every SM many chunks (2^31 elements -> 131072 chunks) and large enough
// that the per-chunk overhead (descriptor and derived loads, a block reduction) is amortised over
// several passes of the block. 2000 tensors of 4096 elements are one chunk each. A multiple of 8,
// so every chunk of a tensor starts at the tensor's own offset from a 16-byte boundary for every
// dtype (the vector path's condition is then the same for all chunks of a tensor).
constexpr int32_t kChunkElems = 16384;

// Resident threads per SM by compute capability (the driver's occupancy tables).
int max_threads_per_sm(int arch) {
  if (arch == 86 || arch == 87 || arch == 89 || arch >= 120) return 1536;
  if (arch < 80) return 1024;
  return 2048;
}

// Blocks of `threads` threads one SM holds for a kernel using `regs` registers per thread:
// registers go to warps in units of 256, 16K per SM sub-partition, 4 sub-partitions.
int resident_blocks(int regs, int threads, int arch) {
  int per_warp = (std::max(regs, 1) * 32 + 255) / 256 * 256;
  int warps_by_regs = 4 * (16384 / per_warp);
  int by_regs = warps_by_regs / std::max(threads / 32, 1);
  int by_threads = max_threads_per_sm(arch) / threads;
  return std::max(1, std::min({by_regs, by_threads, 32}));
}

class CudaExecutor : public Executor {
 public:
  explicit CudaExecutor(const Plan& plan) : plan_(plan), source_(generate_cuda_source(plan)) {
    threads_ = cuda_block_threads();
    device_ = cuda::current_device();
    std::vector<std::string> options = {"--fmad=false"};  // round every op as written: match the CPU
    // Tuning knob for benchmarks: extra -D options (e.g. "-DOF_ELEMS_PER_PASS=16 -DOF_MIN_BLOCKS=1").
    std::string defines;
    if (const char* e = std::getenv("OPTFUSE_CUDA_DEFINES")) {
      std::istringstream words(e);
      for (std::string w; words >> w;) {
        if (w.rfind("-D", 0) != 0) throw Error("OPTFUSE_CUDA_DEFINES takes -DNAME=VALUE words only, got '" + w + "'");
        options.push_back(w);
        defines += " " + w;
      }
    }
    cuda::CompileResult r = cuda::compile(source_, "optfuse", device_.arch(), options);
    module_ = std::make_unique<cuda::Module>(r.cubin);
    for (size_t i = 0; i < plan.phases.size(); ++i) {
      scalar_fns_.push_back(module_->function("of_scalar_phase" + std::to_string(i)));
      std::string name = "of_phase" + std::to_string(i);
      element_fns_.push_back(module_->function(name));
      int regs = module_->resources(name).registers;
      resident_.push_back(static_cast<int64_t>(device_.sm_count) * resident_blocks(regs, threads_, device_.arch()));
    }
    grid_.assign(plan.phases.size(), 0u);  // no tensors yet: scalar kernels only
    char buf[320];
    std::snprintf(buf, sizeof buf, "CUDA sm_%d (%s, %d SMs): %s (%.3f s)%s%s", device_.arch(), device_.name.c_str(),
                  device_.sm_count, r.from_cache ? "cached cubin" : "compiled by NVRTC now", r.seconds,
                  defines.empty() ? "" : ", tuned:", defines.c_str());
    status_ = buf;
  }

  std::string source() const override { return source_; }
  std::string status() const override { return status_; }

  void resize_groups(int groups) override {
    const ScalarLayout& L = plan_.layout;
    std::vector<double> fresh(static_cast<size_t>(L.size(groups)), 0.0);
    if (groups_ > 0) {  // keep the step counts of groups that stay (they live on the device)
      std::vector<double> old(static_cast<size_t>(L.size(groups_)));
      cuda::copy_to_host(old.data(), table_.ptr(), old.size() * sizeof(double), stream_);
      for (int g = 0; g < groups && g < groups_; ++g)
        fresh[static_cast<size_t>(L.steps_offset(groups) + g)] = old[static_cast<size_t>(L.steps_offset(groups_) + g)];
    }
    cuda::DeviceBuffer table(fresh.size() * sizeof(double));
    cuda::copy_to_device(table.ptr(), fresh.data(), fresh.size() * sizeof(double), stream_);
    cuda::stream_synchronize(stream_);  // the old table may still be in use until here
    table_ = std::move(table);
    groups_ = groups;
  }

  // Ordered on the stream of the last step: a write between graph replays lands after the replay
  // before it and before the one after it. Before the first step the stream a step will use is not
  // known, so the write is waited for.
  void write_hypers(const std::vector<double>& hypers) override {
    cuda::copy_to_device(table_at(plan_.layout.hypers_offset()), hypers.data(), hypers.size() * sizeof(double), stream_);
    settle_if_no_step_yet();
  }

  int64_t read_step(int group) override {
    double steps = 0;
    cuda::copy_to_host(&steps, table_at(plan_.layout.steps_offset(groups_) + group), sizeof steps, stream_);
    return static_cast<int64_t>(steps);
  }

  void write_step(int group, int64_t steps) override {
    double v = static_cast<double>(steps);
    cuda::copy_to_device(table_at(plan_.layout.steps_offset(groups_) + group), &v, sizeof v, stream_);
    settle_if_no_step_yet();
  }

  void set_tensors(const std::vector<TensorRef>& tensors) override {
    check_alignment(tensors);
    std::vector<uint64_t> words = build_tensor_table(tensors, plan_.num_states());
    std::vector<Chunk> chunks = build_chunks(tensors, kChunkElems);
    cuda::DeviceBuffer table(words.size() * sizeof(uint64_t)), chunk_buf(chunks.size() * sizeof(Chunk));
    cuda::DeviceBuffer partials(plan_.reductions.size() * chunks.size() * sizeof(double));
    cuda::copy_to_device(table.ptr(), words.data(), words.size() * sizeof(uint64_t), stream_);
    cuda::copy_to_device(chunk_buf.ptr(), chunks.data(), chunks.size() * sizeof(Chunk), stream_);
    if (partials.size()) cuda::memset_zero(partials.ptr(), partials.size(), stream_);
    // Setup, not a step: wait, so that the old buffers are free to go and a step on any stream
    // sees the new ones.
    cuda::stream_synchronize(stream_);
    tensor_table_ = std::move(table);
    chunks_ = std::move(chunk_buf);
    partials_ = std::move(partials);
    num_chunks_ = static_cast<long long>(chunks.size());
    // Grid per phase: the blocks the GPU holds at once, capped by the chunk count, then evened out
    // so every block walks the same number of chunks (no last round with a few busy blocks).
    grid_.clear();
    for (int64_t resident : resident_) {
      int64_t n = num_chunks_, rounds = n == 0 ? 0 : (n + resident - 1) / resident;
      grid_.push_back(rounds == 0 ? 0u : static_cast<unsigned>((n + rounds - 1) / rounds));
    }
  }

  // Same shapes, new pointers (e.g. gradients the framework reallocated): the table is rewritten in
  // place, ordered on the last step's stream, so a captured graph's next replay uses the new
  // pointers; the chunk list stays.
  void update_pointers(const std::vector<TensorRef>& tensors) override {
    check_alignment(tensors);
    std::vector<uint64_t> words = build_tensor_table(tensors, plan_.num_states());
    if (words.size() * sizeof(uint64_t) != tensor_table_.size()) return set_tensors(tensors);
    cuda::copy_to_device(tensor_table_.ptr(), words.data(), words.size() * sizeof(uint64_t), stream_);
    settle_if_no_step_yet();
  }

  void step(const StepInputs& in) override {
    CUstream s = static_cast<CUstream>(in.stream);
    stream_ = s;
    stepped_ = true;
    CUdeviceptr table = table_.ptr(), partials = partials_.ptr(), tensors = tensor_table_.ptr(), chunks = chunks_.ptr();
    int groups = groups_;
    long long n = num_chunks_;
    const float* grad_scale = in.grad_scale;
    const float* found_inf = in.found_inf;
    void* scalar_args[] = {&table, &groups, &partials, &n, &grad_scale, &found_inf};
    void* element_args[] = {&tensors, &chunks, &n, &table, &groups, &partials};
    for (size_t i = 0; i < plan_.phases.size(); ++i) {
      // The scalar kernel always runs (it commits step counts even with no tensors).
      cuda::launch(scalar_fns_[i], 1, static_cast<unsigned>(threads_), 0, s, scalar_args);
      if (grid_[i] > 0) cuda::launch(element_fns_[i], grid_[i], static_cast<unsigned>(threads_), 0, s, element_args);
    }
  }

 private:
  // 16-bit and 32-bit element loads need element-aligned addresses; say which buffer is not.
  static void check_alignment(const std::vector<TensorRef>& tensors) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorRef& r = tensors[t];
      std::vector<const Buffer*> bufs = {&r.param, &r.grad};
      for (const Buffer& b : r.states) bufs.push_back(&b);
      for (size_t k = 0; k < bufs.size(); ++k)
        if (reinterpret_cast<uintptr_t>(bufs[k]->data) % dtype_size(bufs[k]->dtype) != 0)
          throw Error("tensor " + std::to_string(t) + ": buffer " + std::to_string(k) + " is not aligned to its " +
                      std::to_string(dtype_size(bufs[k]->dtype)) + "-byte elements");
    }
  }
  void settle_if_no_step_yet() {
    if (!stepped_) cuda::stream_synchronize(stream_);
  }
  CUdeviceptr table_at(int offset) const { return table_.ptr() + static_cast<CUdeviceptr>(offset) * sizeof(double); }

  const Plan& plan_;
  std::string source_, status_;
  cuda::Device device_;
  int threads_ = 0;
  std::unique_ptr<cuda::Module> module_;
  std::vector<CUfunction> scalar_fns_, element_fns_;
  std::vector<int64_t> resident_;  // per phase: blocks the whole GPU holds at once
  std::vector<unsigned> grid_;     // per phase, for the current tensor set
  int groups_ = 0;
  cuda::DeviceBuffer table_, tensor_table_, chunks_, partials_;
  long long num_chunks_ = 0;
  CUstream stream_ = nullptr;      // stream of the last step: scalar writes are ordered on it
  bool stepped_ = false;
};

}  // namespace

std::unique_ptr<Executor> make_cuda_executor(const Plan& plan) {
  std::string why;
  if (!cuda::driver_available(&why)) throw BackendUnavailable("CUDA backend unavailable: " + why);
  if (!cuda::nvrtc_available(&why)) throw BackendUnavailable("CUDA backend unavailable: " + why);
  return std::make_unique<CudaExecutor>(plan);
}

}  // namespace optfuse
