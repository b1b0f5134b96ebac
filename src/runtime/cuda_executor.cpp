// The CUDA backend: the plan's generated CUDA (codegen/cuda_source.cpp) compiled once by NVRTC for
// the current device (cached on disk by content), a device-resident scalar table, and per step one
// launch per phase on the caller's stream.
//
// Nothing on the step path waits for the device or allocates: grad_scale and found_inf are read on
// the device, skip decisions and step counts stay there, bound hyperparameters are read by the
// kernel, and host-side writes (hyperparameters, step counts, new gradient pointers, a rebuilt
// tensor table) are copied into page-locked staging slots and queued on the stream (Uploader
// below). Buffers a rebuild replaces are freed once the work queued before it has run. So a step
// can be captured in a CUDA graph and replayed; a captured step also captures the upload of the
// gradient pointers it was captured with, so replays use their own pointers whatever eager steps did
// in between. The source holds no shapes, group count or hyperparameter values, so the NVRTC cache
// has one entry per chain structure and device arch.
//
// Uploads are queued on the stream of the last step (before the first step: the legacy default
// stream); a step on another stream first waits, on the device, for the uploads queued so far.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>

#include "codegen/cuda_matrix_source.h"
#include "codegen/cuda_source.h"
#include "optfuse/error.h"
#include "runtime/chunks.h"
#include "runtime/cuda_api.h"
#include "runtime/executor.h"
#include "runtime/matrix_tables.h"
#include "runtime/tensor_table.h"

namespace optfuse {

namespace {

const int32_t kChunkElems = chunk_elements(Backend::cuda);  // why this size: chunk_elements()
// Bytes of one pass kernel's counters (its done_count argument).
const size_t kPassCounterBytes = static_cast<size_t>(cuda_pass_counters()) * sizeof(unsigned);

// A matrix plan's chunk budget: cuda_matrix_chunk_elements(), or, as a tuning knob for benchmarks,
// OPTFUSE_CUDA_MATRIX_CHUNK_ELEMENTS (1024 to that default; chunks still hold at most OF_MROWS rows).
// Smaller chunks would spread a small model's passes more evenly over the blocks but cost more
// column partials: on the H200 every smaller budget was slower (docs/performance.md). Read once per
// process, so every executor (and a sharded step's map) agrees.
int32_t matrix_chunk_elements() {
  static const int32_t elems = [] {
    const int32_t standard = cuda_matrix_chunk_elements();
    const char* e = std::getenv("OPTFUSE_CUDA_MATRIX_CHUNK_ELEMENTS");
    if (!e || !*e) return standard;
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (*end != '\0' || v < 1024 || v > standard)
      throw Error("OPTFUSE_CUDA_MATRIX_CHUNK_ELEMENTS takes a number from 1024 to " + std::to_string(standard) + ", got '" +
                  e + "'");
    return static_cast<int32_t>(v);
  }();
  return elems;
}

// A matrix plan's tables on the device, passed by value to its kernels: the generated struct
// OfMatrixTables (codegen/cuda_matrix_source.cpp) matches.
struct DeviceMatrixTables {
  uint64_t matrices = 0, row_reductions = 0, col_partials = 0, col_reductions = 0, row_values = 0, col_values = 0;
  uint64_t item_sums = 0, finished = 0, matrix_sums = 0;
};
static_assert(sizeof(DeviceMatrixTables) == 72, "DeviceMatrixTables is shared with generated code (OfMatrixTables)");

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

// Host -> device uploads that never make the host wait: the data is copied into a page-locked
// slot and the copy is queued on the stream. A slot is reused once the copy queued from it has run
// (an event says so); while every slot is in flight a new one is made (the host may run many steps
// ahead of the device), up to kMaxSlots, then the oldest is waited for. A copy captured into a CUDA
// graph reads its slot at every replay, so that slot belongs to the executor for good; it is a
// spare made beforehand, because events cannot be queried (nor, safely, memory pinned) while a
// stream is being captured.
// Page-locked memory is never freed while the process runs: cuMemFreeHost waits for all work
// queued on the device (measured on the H200: a new optimizer's set_tensors and destroying one
// waited for 300 ms of queued work, docs/performance.md). A slot too small for an upload is kept
// and a bigger one made; an Uploader that is destroyed hands its slots, with their events, to a
// process-wide pool (SlotPool) that new Uploaders draw from, and the buffers captured graphs read
// are kept for good.
struct UploadSlot {
  cuda::PinnedBuffer buf;
  std::unique_ptr<cuda::Event> done;  // made at the first copy (a destructor may hand back bare buffers)
  bool in_flight = false;
  bool free() const { return !in_flight || done->done(); }
  void record(CUstream stream) {
    if (!done) done = std::make_unique<cuda::Event>();
    done->record(stream);
    in_flight = true;
  }
};

class SlotPool {
 public:
  static SlotPool& instance() {
    static auto* pool = new SlotPool();  // never destroyed (see above)
    return *pool;
  }
  void give(std::unique_ptr<UploadSlot> slot) {
    std::lock_guard<std::mutex> lock(m_);
    slots_.push_back(std::move(slot));
  }
  void give(cuda::PinnedBuffer&& buf) {
    if (buf.size() == 0) return;
    auto slot = std::make_unique<UploadSlot>();
    slot->buf = std::move(buf);
    give(std::move(slot));
  }
  // A free slot of at least `bytes` (the smallest such), or null.
  std::unique_ptr<UploadSlot> take(size_t bytes) {
    std::lock_guard<std::mutex> lock(m_);
    size_t best = slots_.size();
    for (size_t k = 0; k < slots_.size(); ++k)
      if (slots_[k]->buf.size() >= bytes && (best == slots_.size() || slots_[k]->buf.size() < slots_[best]->buf.size()) &&
          slots_[k]->free())
        best = k;
    if (best == slots_.size()) return nullptr;
    std::unique_ptr<UploadSlot> slot = std::move(slots_[best]);
    slots_.erase(slots_.begin() + static_cast<std::ptrdiff_t>(best));
    slot->in_flight = false;
    return slot;
  }
  void keep_forever(std::vector<cuda::PinnedBuffer>&& bufs) {
    std::lock_guard<std::mutex> lock(m_);
    for (cuda::PinnedBuffer& b : bufs) kept_.push_back(std::move(b));
  }

 private:
  std::mutex m_;
  std::vector<std::unique_ptr<UploadSlot>> slots_;
  std::vector<cuda::PinnedBuffer> kept_;  // read by captured graphs (never reused), and never freed
};

class Uploader {
 public:
  ~Uploader() {
    SlotPool& pool = SlotPool::instance();
    for (std::unique_ptr<UploadSlot>& s : slots_) pool.give(std::move(s));
    pool.give(std::move(spare_));
    pool.keep_forever(std::move(graph_owned_));
  }

  void upload(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
    upload(dst, src, bytes, stream, cuda::stream_is_capturing(stream));
  }
  // The same, where the caller knows whether `stream` is being captured (the step asks once).
  void upload(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream, bool capturing) {
    if (bytes == 0) return;
    if (capturing) return upload_captured(dst, src, bytes, stream);
    make_spare();
    UploadSlot& slot = free_slot(bytes);
    std::memcpy(slot.buf.data(), src, bytes);
    cuda::copy_pinned_to_device_async(dst, slot.buf.data(), bytes, stream);
    slot.record(stream);
  }
  // Makes sure a captured upload of up to `bytes` finds its spare ready.
  void reserve_spare(size_t bytes) {
    spare_bytes_ = std::max(spare_bytes_, bytes);
    make_spare();
  }

 private:
  static constexpr size_t kMaxSlots = 64;
  void make_spare() {
    if (spare_.size() >= spare_bytes_) return;
    SlotPool::instance().give(std::move(spare_));  // (never freed: see above)
    spare_ = cuda::PinnedBuffer(spare_bytes_);
  }
  UploadSlot& free_slot(size_t bytes) {
    for (size_t k = 0; k < slots_.size(); ++k) {
      UploadSlot& s = *slots_[(next_ + k) % slots_.size()];
      if (s.buf.size() < bytes || !s.free()) continue;
      s.in_flight = false;
      next_ = (next_ + k + 1) % slots_.size();
      return s;
    }
    std::unique_ptr<UploadSlot> slot = SlotPool::instance().take(bytes);
    if (!slot && slots_.size() >= kMaxSlots) {  // every slot is in flight or too small: the host is
      UploadSlot& oldest = *slots_[next_];     // far ahead; wait for the oldest, and let it grow
      if (oldest.in_flight) oldest.done->wait();
      oldest.in_flight = false;
      next_ = (next_ + 1) % slots_.size();
      if (oldest.buf.size() < bytes) {
        SlotPool::instance().give(std::move(oldest.buf));
        oldest.buf = cuda::PinnedBuffer(bytes);
      }
      return oldest;
    }
    if (!slot) {
      slot = std::make_unique<UploadSlot>();
      slot->buf = cuda::PinnedBuffer(std::max<size_t>(bytes, 4096));
    }
    slots_.push_back(std::move(slot));
    return *slots_.back();
  }
  void upload_captured(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
    cuda::PinnedBuffer buf = spare_.size() >= bytes ? std::move(spare_) : cuda::PinnedBuffer(bytes);
    spare_ = cuda::PinnedBuffer();
    std::memcpy(buf.data(), src, bytes);
    cuda::copy_pinned_to_device_async(dst, buf.data(), bytes, stream);
    graph_owned_.push_back(std::move(buf));
    spare_bytes_ = std::max(spare_bytes_, bytes);  // the next capture finds one again
  }
  std::vector<std::unique_ptr<UploadSlot>> slots_;
  size_t next_ = 0;
  cuda::PinnedBuffer spare_;
  size_t spare_bytes_ = 0;
  std::vector<cuda::PinnedBuffer> graph_owned_;
};

class CudaExecutor : public Executor {
 public:
  explicit CudaExecutor(PlanPtr plan)
      : plan_ptr_(std::move(plan)), plan_(*plan_ptr_), variants_(default_variants(plan_)) {
    threads_ = cuda_block_threads();
    device_ = cuda::current_device();
    compile();
    // Each phase's counters (cuda_pass_counters(); its last block resets them), zeroed once.
    counters_ = cuda::DeviceBuffer::ordered(std::max<size_t>(plan_.phases.size(), 1) * kPassCounterBytes, stream_);
    cuda::memset_zero(counters_.ptr(), counters_.size(), stream_);
  }
  // Every buffer's free is queued on the stream of the last step (stream-ordered memory, see
  // cuda::DeviceBuffer): destroying an optimizer neither waits for its queued steps nor frees
  // memory they still read. (A new DeviceBuffer member belongs in this list.)
  ~CudaExecutor() override {
    for (cuda::DeviceBuffer* b : {&table_, &sources_, &tensor_table_, &chunks_, &partials_, &tensor_reductions_,
                                  &counters_, &global_partials_, &global_spans_})
      b->free_on(stream_);
    for (cuda::DeviceBuffer& b : matrix_buffers_) b.free_on(stream_);
    for (cuda::DeviceBuffer& b : graph_tables_) b.free_on(stream_);
    for (auto& r : retired_) r.first.free_on(stream_);
  }

  // Generates and compiles the kernels for variants_ (NVRTC; cached on disk by content) and loads
  // them (once per process: cuda::shared_module, so a module replaced by a recompile stays loaded
  // while kernels queued from it may still run).
  void compile() {
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
    std::string source = generate_cuda_source(plan_, variants_);
    cuda::CompileResult r = cuda::compile(source, "optfuse", device_.arch(), options);
    std::shared_ptr<const cuda::Module> module = cuda::shared_module(r.cubin);
    std::vector<CUfunction> fns;
    std::vector<int> regs, static_shared;
    std::vector<CUfunction> combine_fns, value_fns;
    for (size_t i = 0; i < plan_.phases.size(); ++i) {
      std::string name = "of_phase" + std::to_string(i);
      fns.push_back(module->function(name));
      if (plan_.matrix()) value_fns.push_back(module->function("of_values" + std::to_string(i)));
      combine_fns.push_back(plan_.phases[i].reductions.empty() ? nullptr : module->function("of_combine" + std::to_string(i)));
      cuda::KernelResources res = module->resources(name);
      regs.push_back(res.registers);
      static_shared.push_back(res.shared_bytes);
    }
    module_ = std::move(module);
    fns_ = std::move(fns);
    combine_fns_ = std::move(combine_fns);
    value_fns_ = std::move(value_fns);
    regs_ = std::move(regs);
    static_shared_ = std::move(static_shared);
    source_ = std::move(source);
    char buf[360];
    std::snprintf(buf, sizeof buf, "CUDA sm_%d (%s, %d SMs): %s (%.3f s), %zu storage variant(s)%s%s", device_.arch(),
                  device_.name.c_str(), device_.sm_count, r.from_cache ? "cached cubin" : "compiled by NVRTC now", r.seconds,
                  variants_.size(), defines.empty() ? "" : ", tuned:", defines.c_str());
    status_ = buf;
  }

  std::string source() const override { return source_; }
  std::string status() const override { return status_; }

  void resize_groups(int groups) override {
    refuse_while_capturing("adding a parameter group");
    const ScalarLayout& L = plan_.layout;
    size_t shared = cuda_uniform_shared_bytes(plan_, groups);
    if (shared > kMaxDynamicShared)
      throw Error("CUDA backend: " + std::to_string(groups) + " parameter groups need " + std::to_string(shared) +
                  " bytes of shared memory per block for their uniform values (at most " +
                  std::to_string(kMaxDynamicShared) + ")");
    std::vector<double> fresh(static_cast<size_t>(L.size(groups)), 0.0);
    const int S = L.uniform_states_per_group;
    for (int g = 0; g < groups; ++g)  // new groups' uniform states start at their init values
      for (int u = 0; u < S; ++u)
        fresh[static_cast<size_t>(L.uniform_states_offset(groups) + g * S + u)] =
            plan_.program.uniform_states[static_cast<size_t>(u)].init;
    cuda::DeviceBuffer table = cuda::DeviceBuffer::ordered(fresh.size() * sizeof(double), stream_);
    uploads_.upload(table.ptr(), fresh.data(), fresh.size() * sizeof(double), stream_);
    if (groups_ > 0) {  // keep the step counts and uniform states of groups that stay (they live on the device)
      const size_t kept = static_cast<size_t>(std::min(groups, groups_));
      cuda::copy_device_to_device(table.ptr() + static_cast<CUdeviceptr>(L.steps_offset(groups)) * sizeof(double),
                                  table_at(L.steps_offset(groups_)), kept * sizeof(double), stream_);
      if (S > 0)  // rows [group][S]: the kept groups' rows are one contiguous block
        cuda::copy_device_to_device(
            table.ptr() + static_cast<CUdeviceptr>(L.uniform_states_offset(groups)) * sizeof(double),
            table_at(L.uniform_states_offset(groups_)), kept * static_cast<size_t>(S) * sizeof(double), stream_);
    }
    retire(std::move(table_));
    table_ = std::move(table);
    retire(std::move(sources_));
    sources_ = cuda::DeviceBuffer::ordered(static_cast<size_t>(groups) * static_cast<size_t>(L.hypers_per_group) * sizeof(HyperSource), stream_);
    groups_ = groups;
    shared_bytes_ = shared;
    compute_grid();
  }

  void write_hypers(const std::vector<double>& hypers) override {
    uploads_.upload(table_at(plan_.layout.hypers_offset()), hypers.data(), hypers.size() * sizeof(double), stream_);
  }

  void write_hyper_sources(const std::vector<HyperSource>& sources) override {
    if (sources.size() * sizeof(HyperSource) != sources_.size())
      throw Error("CUDA backend: hyperparameter sources do not match the group count");
    uploads_.upload(sources_.ptr(), sources.data(), sources_.size(), stream_);
  }

  int64_t read_step(int group) override {
    double steps = 0;
    cuda::copy_to_host(&steps, table_at(plan_.layout.steps_offset(groups_) + group), sizeof steps, stream_);
    return static_cast<int64_t>(steps);
  }

  void write_step(int group, int64_t steps) override {
    double v = static_cast<double>(steps);
    uploads_.upload(table_at(plan_.layout.steps_offset(groups_) + group), &v, sizeof v, stream_);
  }

  double read_uniform_state(int group, int slot) override {
    double v = 0;
    const ScalarLayout& L = plan_.layout;
    cuda::copy_to_host(&v, table_at(L.uniform_states_offset(groups_) + group * L.uniform_states_per_group + slot), sizeof v,
                       stream_);
    return v;
  }

  void write_uniform_state(int group, int slot, double value) override {
    const ScalarLayout& L = plan_.layout;
    uploads_.upload(table_at(L.uniform_states_offset(groups_) + group * L.uniform_states_per_group + slot), &value,
                    sizeof value, stream_);
  }

  // A new tensor set: new device buffers, filled by queued uploads; the old ones are freed once
  // the steps queued before have run. Nothing waits.
  void set_tensors(const std::vector<TensorRef>& tensors) override {
    refuse_while_capturing("changing the tensor set");
    check_alignment(tensors);
    std::vector<StorageVariant> variants = variants_;
    std::vector<int> index;
    if (assign_variants(tensors, variants, index)) {  // a new dtype combination: compile its loops
      std::vector<StorageVariant> old = variants_;
      variants_ = variants;
      try {
        compile();  // (the grid, which depends on register counts, is computed below)
      } catch (...) {
        variants_ = old;
        throw;
      }
    }
    variant_index_ = index;
    const std::vector<Chunk> chunks =
        plan_.matrix() ? build_chunks(tensors, matrix_chunk_elements(), true, cuda_matrix_chunk_rows())
                       : build_chunks(tensors, kChunkElems);
    ranges_ = chunk_ranges(tensors.size(), chunks);
    if (plan_.matrix()) set_matrix_tables(tensors);
    words_ = build_tensor_table(tensors, plan_.num_states(), ranges_, variant_index_);
    cuda::DeviceBuffer table = cuda::DeviceBuffer::ordered(words_.size() * sizeof(uint64_t), stream_);
    cuda::DeviceBuffer chunk_buf = cuda::DeviceBuffer::ordered(chunks.size() * sizeof(Chunk), stream_);
    cuda::DeviceBuffer partials = cuda::DeviceBuffer::ordered(plan_.reductions.size() * chunks.size() * sizeof(double), stream_);
    cuda::DeviceBuffer tensor_reductions =
        cuda::DeviceBuffer::ordered(tensors.size() * static_cast<size_t>(plan_.layout.tensor_reductions) * sizeof(double), stream_);
    uploads_.upload(table.ptr(), words_.data(), words_.size() * sizeof(uint64_t), stream_);
    uploads_.upload(chunk_buf.ptr(), chunks.data(), chunks.size() * sizeof(Chunk), stream_);
    if (partials.size()) cuda::memset_zero(partials.ptr(), partials.size(), stream_);
    if (tensor_reductions.size()) cuda::memset_zero(tensor_reductions.ptr(), tensor_reductions.size(), stream_);
    retire(std::move(tensor_reductions_));
    tensor_reductions_ = std::move(tensor_reductions);
    retire(std::move(tensor_table_));
    retire(std::move(chunks_));
    retire(std::move(partials_));
    tensor_table_ = std::move(table);
    chunks_ = std::move(chunk_buf);
    partials_ = std::move(partials);
    num_chunks_ = static_cast<long long>(chunks.size());
    table_dirty_ = grads_dirty_ = table_captured_ = false;
    uploads_.reserve_spare(words_.size() * sizeof(uint64_t));
    compute_grid();
  }

  int32_t chunk_elements() const override { return plan_.matrix() ? matrix_chunk_elements() : kChunkElems; }

  // A matrix plan's tables for a new tensor set: the per-tensor layout and the Values step's items
  // uploaded, the row and column tables zeroed (the old ones retired, as every buffer here).
  void set_matrix_tables(const std::vector<TensorRef>& tensors) {
    const ScalarLayout& L = plan_.layout;
    const MatrixLayout layout = matrix_layout(tensors, ranges_);
    const std::vector<DeviceMatrix> matrices = device_matrices(tensors, layout);
    const std::vector<ValueItem> items = value_items(tensors, cuda_value_item_cols(), cuda_value_item_rows());
    auto bytes = [](int64_t entries, int per, size_t size) {
      return std::max<size_t>(1, static_cast<size_t>(entries) * static_cast<size_t>(per)) * size;
    };
    const size_t sizes[kNumMatrixBuffers] = {std::max<size_t>(1, matrices.size()) * sizeof(DeviceMatrix),
                            bytes(layout.rows, L.row_reductions, sizeof(double)),
                            bytes(layout.colparts, L.col_reductions, sizeof(double)),
                            bytes(layout.cols, L.col_reductions, sizeof(double)),
                            bytes(layout.rows, L.row_values, sizeof(float)),
                            bytes(layout.cols, L.col_values, sizeof(float)),
                            std::max<size_t>(1, items.size()) * sizeof(ValueItem),
                            bytes(static_cast<int64_t>(items.size()), L.tensor_reductions, sizeof(double)),
                            std::max<size_t>(1, static_cast<size_t>(layout.matrices)) * sizeof(unsigned),
                            bytes(layout.matrices, L.tensor_reductions, sizeof(double))};
    for (cuda::DeviceBuffer& b : matrix_buffers_) retire(std::move(b));
    matrix_buffers_.clear();
    for (size_t b = 0; b < kNumMatrixBuffers; ++b) {
      matrix_buffers_.push_back(cuda::DeviceBuffer::ordered(sizes[b], stream_));
      cuda::memset_zero(matrix_buffers_.back().ptr(), sizes[b], stream_);
    }
    if (!matrices.empty())
      uploads_.upload(matrix_buffers_[kMatrices].ptr(), matrices.data(), matrices.size() * sizeof(DeviceMatrix), stream_);
    if (!items.empty())
      uploads_.upload(matrix_buffers_[kItems].ptr(), items.data(), items.size() * sizeof(ValueItem), stream_);
    num_items_ = static_cast<int>(items.size());
    auto at = [&](MatrixBuffer b) { return static_cast<uint64_t>(matrix_buffers_[b].ptr()); };
    matrix_tables_ = {at(kMatrices),  at(kRowReductions), at(kColPartials), at(kColReductions),
                      at(kRowValues), at(kColValues),     at(kItemSums),    at(kFinished), at(kMatrixSums)};
  }

  // A sharded step: a device buffer for every rank's partials and the tensors' global spans.
  void set_exchange(const ShardMap& map, ExchangeFn fn) override {
    refuse_while_capturing("setting a partial-sum exchange");
    exchange_fn_ = std::move(fn);
    global_chunks_ = exchange_fn_ ? map.global_chunks : 0;
    retire(std::move(global_partials_));
    retire(std::move(global_spans_));
    if (!exchange_fn_) return;
    global_partials_ = cuda::DeviceBuffer::ordered(std::max<size_t>(1, plan_.reductions.size() * static_cast<size_t>(global_chunks_)) * sizeof(double), stream_);
    std::vector<int32_t> spans;
    for (const ChunkSpan& sp : map.tensors) {
      spans.push_back(static_cast<int32_t>(sp.first));
      spans.push_back(static_cast<int32_t>(sp.count));
    }
    global_spans_ = cuda::DeviceBuffer::ordered(std::max<size_t>(1, spans.size()) * sizeof(int32_t), stream_);
    if (!spans.empty()) uploads_.upload(global_spans_.ptr(), spans.data(), spans.size() * sizeof(int32_t), stream_);
    cuda::memset_zero(global_partials_.ptr(), global_partials_.size(), stream_);
  }

  // Same shapes, new pointers (gradients the framework reallocated): only the host copy of the
  // table changes here; the next step uploads it (ordered before its kernels).
  void update_pointers(const std::vector<TensorRef>& tensors) override {
    check_alignment(tensors);
    if (tensors.size() != ranges_.size()) return set_tensors(tensors);  // another tensor set: new chunks
    std::vector<uint64_t> words = build_tensor_table(tensors, plan_.num_states(), ranges_, variant_index_);
    // Rows that differ other than in their gradient word (a parameter or a state moved: the
    // torch.compile path hands over copies) need the whole table; gradients alone only the tail.
    const size_t row = tensor_row_words(plan_.num_states());
    const size_t tail = grad_tail_word(ranges_.size(), plan_.num_states());
    bool rows_changed = false;
    for (size_t w = 0; w < tail && !rows_changed; ++w) rows_changed = w % row != kGradWord && words[w] != words_[w];
    words_ = std::move(words);
    grads_dirty_ = true;
    if (rows_changed) {
      table_dirty_ = true;
      if (table_captured_) {
        // A captured graph reads this table's rows at every replay: they stay as captured, and
        // eager steps go on with a new table.
        cuda::DeviceBuffer table = cuda::DeviceBuffer::ordered(words_.size() * sizeof(uint64_t), stream_);
        graph_tables_.push_back(std::move(tensor_table_));
        tensor_table_ = std::move(table);
        table_captured_ = false;
      }
    }
  }

  // Gradients alone moved: their words change (the next step uploads the tail), the rows stay.
  void update_grad_pointers(const std::vector<TensorRef>& tensors) override {
    if (tensors.size() != ranges_.size()) return set_tensors(tensors);
    for (size_t t = 0; t < tensors.size(); ++t) check_aligned(tensors[t].grad, t, 1);
    patch_grad_words(words_, tensors, plan_.num_states());
    grads_dirty_ = true;
  }

  void step(const StepInputs& in) override {
    CUstream s = static_cast<CUstream>(in.stream);
    const bool capturing = cuda::stream_is_capturing(s);
    if (s != stream_ && !capturing) {
      // Uploads so far were queued on the previous stream: this stream waits for them on the device.
      uploaded_.record(stream_);
      uploaded_.make_wait(s);
      stream_ = s;
    }
    // A captured step carries its own gradient pointers (replays must not depend on what eager
    // steps uploaded since: 8 bytes per tensor, the table's tail); an eager step uploads them only
    // when they changed, and the whole table only when other pointers did.
    if (table_dirty_) {
      uploads_.upload(tensor_table_.ptr(), words_.data(), words_.size() * sizeof(uint64_t), s, capturing);
    } else if (grads_dirty_ || capturing) {
      const size_t tail = grad_tail_word(ranges_.size(), plan_.num_states());
      uploads_.upload(tensor_table_.ptr() + tail * sizeof(uint64_t), words_.data() + tail,
                      (words_.size() - tail) * sizeof(uint64_t), s, capturing);
    }
    if (capturing) {
      table_captured_ = true;
      grads_dirty_ = true;  // the capture has not changed the device copy yet (nor the rows, if dirty)
    } else {
      table_dirty_ = grads_dirty_ = false;
    }
    CUdeviceptr table = table_.ptr(), partials = partials_.ptr(), tensors = tensor_table_.ptr(), chunks = chunks_.ptr();
    CUdeviceptr sources = sources_.ptr(), tensor_reductions = tensor_reductions_.ptr();
    int groups = groups_, num_tensors = static_cast<int>(ranges_.size());
    long long n = num_chunks_;
    const float* grad_scale = in.grad_scale;
    const float* found_inf = in.found_inf;
    if (exchange_fn_ && capturing)
      throw Error("CUDA backend: a step with a partial-sum exchange (a sharded step) cannot be captured in a CUDA graph");
    int combine_here = exchange_fn_ ? 0 : 1;
    // The schedule, literally; Scalar steps run in every block's prologue of the next pass, and a
    // Combine in the last block of its pass unless an exchange is set (then it is a launch of its own).
    for (const ScheduleStep& st : plan_.schedule) {
      const size_t i = static_cast<size_t>(st.phase);
      if (st.kind == ScheduleStep::Kind::Pass) {
        CUdeviceptr counter = counters_.ptr() + i * kPassCounterBytes;
        void* args[] = {&tensors, &chunks, &n, &table, &groups, &partials, &tensor_reductions, &num_tensors,
                        &sources, &grad_scale, &found_inf, &counter, &combine_here, &matrix_tables_};  // (the last: matrix plans)
        cuda::launch(fns_[i], grid_[i], static_cast<unsigned>(threads_), shared_bytes_, s, args);
      } else if (st.kind == ScheduleStep::Kind::Values) {  // a block per item (matrix_tables.h, ValueItem)
        CUdeviceptr items = matrix_buffers_[kItems].ptr();
        int num_items = num_items_;
        void* args[] = {&tensors, &items, &num_items, &table, &groups, &tensor_reductions, &sources, &grad_scale,
                        &found_inf, &matrix_tables_};
        const unsigned grid = static_cast<unsigned>(std::clamp<int64_t>(num_items_, 1, int64_t{device_.sm_count} * 8));
        cuda::launch(value_fns_[i], grid, static_cast<unsigned>(threads_), shared_bytes_, s, args);
      } else if (st.kind == ScheduleStep::Kind::Exchange && exchange_fn_) {
        PartialSums ps;
        ps.phase = st.phase;
        for (NodeId node : plan_.phases[i].reductions) ps.reductions.push_back(static_cast<int>(plan_.reduction_index(node)));
        ps.local_chunks = n;
        ps.local = reinterpret_cast<const double*>(static_cast<uintptr_t>(partials));
        ps.global_chunks = global_chunks_;
        ps.global = reinterpret_cast<double*>(static_cast<uintptr_t>(global_partials_.ptr()));
        ps.on_device = true;
        exchange_fn_(ps);
      } else if (st.kind == ScheduleStep::Kind::Combine && exchange_fn_) {
        CUdeviceptr global = global_partials_.ptr(), spans = global_spans_.ptr();
        long long cols = global_chunks_;
        void* args[] = {&global, &cols, &spans, &num_tensors, &table, &tensor_reductions};
        cuda::launch(combine_fns_[i], 1, static_cast<unsigned>(threads_), 0, s, args);
      }
    }
    if (!capturing) reap();
  }

 private:
  static constexpr size_t kMaxDynamicShared = 200 * 1024;  // below every sm_80+ part's opt-in limit

  void refuse_while_capturing(const char* what) {
    if (cuda::stream_is_capturing(stream_))
      throw Error(std::string("CUDA backend: ") + what + " while the stream is being captured into a CUDA graph; "
                  "step once outside the capture first, so that the capture only launches");
  }

  // Grid per phase: the blocks the GPU holds at once (registers, threads and shared memory), capped
  // by the chunk count, then evened out so every block walks the same number of chunks (no last
  // round with a few busy blocks). At least one block: it commits the step even with no tensors.
  void compute_grid() {
    grid_.clear();
    for (size_t i = 0; i < fns_.size(); ++i) {
      int per_sm = resident_blocks(regs_[i], threads_, device_.arch());
      size_t shared = shared_bytes_ + static_cast<size_t>(static_shared_[i]) + 1024;  // 1 KiB reserved per block
      per_sm = std::max(1, std::min<int>(per_sm, static_cast<int>((228u * 1024u) / shared)));
      int64_t resident = static_cast<int64_t>(device_.sm_count) * per_sm;
      int64_t n = num_chunks_, rounds = n == 0 ? 1 : (n + resident - 1) / resident;
      grid_.push_back(n == 0 ? 1u : static_cast<unsigned>((n + rounds - 1) / rounds));
    }
  }

  // A buffer still read by queued work: freed once that work has run.
  void retire(cuda::DeviceBuffer&& b) {
    if (b.size() == 0) return;
    b.free_on(stream_);
    retired_.push_back({std::move(b), std::make_unique<cuda::Event>()});
    retired_.back().second->record(stream_);
  }
  void reap() {
    while (!retired_.empty() && retired_.front().second->done()) retired_.erase(retired_.begin());
  }

  // 16-bit and 32-bit element loads need element-aligned addresses; say which buffer is not.
  // Buffer k of tensor t (0 param, 1 grad, 2... states) holds whole elements at aligned addresses.
  static void check_aligned(const Buffer& b, size_t t, size_t k) {
    if (reinterpret_cast<uintptr_t>(b.data) % dtype_size(b.dtype) != 0)
      throw Error("tensor " + std::to_string(t) + ": buffer " + std::to_string(k) + " is not aligned to its " +
                  std::to_string(dtype_size(b.dtype)) + "-byte elements");
  }
  static void check_alignment(const std::vector<TensorRef>& tensors) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorRef& r = tensors[t];
      check_aligned(r.param, t, 0);
      check_aligned(r.grad, t, 1);
      for (size_t s = 0; s < r.states.size(); ++s) check_aligned(r.states[s], t, 2 + s);
    }
  }
  CUdeviceptr table_at(int offset) const { return table_.ptr() + static_cast<CUdeviceptr>(offset) * sizeof(double); }

  PlanPtr plan_ptr_;
  const Plan& plan_;  // *plan_ptr_, which this executor keeps alive
  std::string source_, status_;
  cuda::Device device_;
  int threads_ = 0;
  std::vector<StorageVariant> variants_;   // compiled, in OfTensor::variant order
  std::vector<int> variant_index_;         // per tensor
  std::shared_ptr<const cuda::Module> module_;  // kept loaded for the process (cuda::shared_module)
  std::vector<CUfunction> fns_;
  std::vector<CUfunction> combine_fns_;    // per phase: of_combine<i> for reduce phases, else null
  std::vector<CUfunction> value_fns_;      // matrix plans, per phase: of_values<i> (the Values step)
  // Matrix plans: per tensor set, the tables (DeviceMatrix rows, row reductions, column partials,
  // column reductions, row values, column values), the Values step's items, their sums of row
  // values, the per-matrix counters of finished row items and each matrix's sums of row values.
  enum MatrixBuffer { kMatrices, kRowReductions, kColPartials, kColReductions, kRowValues, kColValues, kItems,
                      kItemSums, kFinished, kMatrixSums, kNumMatrixBuffers };
  std::vector<cuda::DeviceBuffer> matrix_buffers_;
  DeviceMatrixTables matrix_tables_;
  int num_items_ = 0;
  std::vector<int> regs_, static_shared_;  // per phase
  std::vector<unsigned> grid_;             // per phase, for the current tensor set and group count
  size_t shared_bytes_ = 0;                // dynamic shared memory per block (the groups' uniforms)
  int groups_ = 0;
  cuda::DeviceBuffer table_, sources_, tensor_table_, chunks_, partials_, tensor_reductions_, counters_;
  std::vector<ChunkRange> ranges_;         // per tensor, its chunks (tensor-table words, per set_tensors)
  std::vector<uint64_t> words_;            // host copy of the tensor table
  bool table_dirty_ = false;               // words_' rows differ from the device copy
  bool grads_dirty_ = false;               // words_' gradient tail (tensor_table.h) differs from the device copy
  bool table_captured_ = false;            // a CUDA graph captured a step reading tensor_table_
  std::vector<cuda::DeviceBuffer> graph_tables_;  // tables captured graphs read, replaced since
  long long num_chunks_ = 0;
  CUstream stream_ = nullptr;              // stream of the last step: uploads are queued on it
  Uploader uploads_;
  cuda::Event uploaded_;
  std::vector<std::pair<cuda::DeviceBuffer, std::unique_ptr<cuda::Event>>> retired_;
  ExchangeFn exchange_fn_;                 // a sharded step's exchange (empty: unsharded)
  long long global_chunks_ = 0;
  cuda::DeviceBuffer global_partials_, global_spans_;  // [reduction][global chunk], [tensor][2]
};

}  // namespace

std::unique_ptr<Executor> make_cuda_executor(PlanPtr plan) {
  std::string why;
  if (!cuda::driver_available(&why)) throw BackendUnavailable("CUDA backend unavailable: " + why);
  if (!cuda::nvrtc_available(&why)) throw BackendUnavailable("CUDA backend unavailable: " + why);
  return std::make_unique<CudaExecutor>(std::move(plan));
}

}  // namespace optfuse
