// The CPU backend: the plan's generated C++ compiled once by the host compiler (cached on disk by
// content hash) and run over fixed chunks of every tensor by the thread pool. Chunks never depend
// on the thread count, so results are bitwise identical for any number of threads. With no
// compiler at run time the same phases are interpreted in float32 (slower; said once on stderr).
#include <cstdio>
#include <mutex>

#include "codegen/abi.h"
#include "codegen/cpu_source.h"
#include "eval/interpreter.h"
#include "optfuse/error.h"
#include "runtime/host_compiler.h"
#include "runtime/host_executor.h"
#include "runtime/tensor_table.h"
#include "runtime/thread_pool.h"

namespace optfuse {

namespace {

using PhaseFn = void (*)(const void* tensors, const Chunk* chunks, long long first, long long last,
                         const double* derived, const double* skip, const double* steps, int derived_per_group,
                         const double* tensor_reductions, int tensor_reductions_per_tensor, double* partials,
                         long long num_chunks);
// A matrix plan's phases also take the matrix tables (codegen/cpu_matrix_source.h).
using MatrixPhaseFn = void (*)(const void* tensors, const Chunk* chunks, long long first, long long last,
                               const double* derived, const double* skip, const double* steps, int derived_per_group,
                               const double* tensor_reductions, int tensor_reductions_per_tensor, double* partials,
                               long long num_chunks, const DeviceMatrix* mats, double* row_red, double* col_part,
                               const double* row_val, const double* col_val, const double* matrix_sums);
// A matrix plan's Values step over matrices [k0, k1) (codegen/cpu_matrix_source.h).
using ValuesFn = void (*)(const void* tensors, const DeviceMatrix* mats, long long num_tensors, long long total_matrices,
                          long long k0, long long k1, const double* derived, int derived_per_group,
                          const double* tensor_reductions, int tensor_reductions_per_tensor, const double* row_red,
                          const double* col_red, double* row_val, double* col_val, double* matrix_sums);

class CpuExecutor : public HostExecutor {
 public:
  explicit CpuExecutor(PlanPtr p) : HostExecutor(std::move(p), optfuse::chunk_elements(Backend::cpu)), variants_(default_variants(plan_)) {
    std::string why;
    if (!host::find_compiler(&why)) {
      static std::once_flag once;
      std::call_once(once, [&] {
        std::fprintf(stderr, "optfuse: no C++ compiler at run time (%s); the CPU backend interprets its plans "
                             "in float32 instead (correct, but much slower)\n", why.c_str());
      });
      source_ = generate_cpu_source(plan_, variants_);
      status_ = "interpreted in float32 (no compiler: " + why + ")";
      return;
    }
    compile();
  }
  std::string source() const override { return source_; }
  std::string status() const override { return status_; }

  void set_tensors(const std::vector<TensorRef>& tensors) override {
    std::vector<StorageVariant> variants = variants_;
    std::vector<int> index;
    if (assign_variants(tensors, variants, index) && lib_) {  // a new dtype combination: compile its loops
      std::vector<StorageVariant> old = variants_;
      variants_ = variants;
      try {
        compile();
      } catch (...) {
        variants_ = old;
        throw;
      }
    }
    variants_ = variants;
    HostExecutor::set_tensors(tensors);
    if (plan_.matrix()) mats_ = device_matrices(tensors_, matrix_.layout);
    variant_index_ = index;
    ranges_ = chunk_ranges(tensors.size(), chunks_);
    table_words_ = build_tensor_table(tensors, plan_.num_states(), ranges_, variant_index_);
  }

  // Same tensors (sizes, dtypes, groups), new data pointers (gradients the framework reallocated):
  // chunks and storage variants stay; only the pointers in the tensor list and the table change.
  void update_pointers(const std::vector<TensorRef>& tensors) override {
    if (tensors.size() != tensors_.size() || ranges_.size() != tensors.size()) return set_tensors(tensors);
    for (size_t t = 0; t < tensors.size(); ++t) {
      tensors_[t].param.data = tensors[t].param.data;
      tensors_[t].grad.data = tensors[t].grad.data;
      for (size_t s = 0; s < tensors_[t].states.size() && s < tensors[t].states.size(); ++s)
        tensors_[t].states[s].data = tensors[t].states[s].data;
    }
    table_words_ = build_tensor_table(tensors, plan_.num_states(), ranges_, variant_index_);
  }

  void update_grad_pointers(const std::vector<TensorRef>& tensors) override {
    if (tensors.size() != tensors_.size() || ranges_.size() != tensors.size()) return set_tensors(tensors);
    for (size_t t = 0; t < tensors.size(); ++t) tensors_[t].grad.data = tensors[t].grad.data;
    patch_grad_words(table_words_, tensors, plan_.num_states());
  }

 protected:
  void run_phase(size_t index) override {
    const ElementPhase& ph = plan_.phases[index];
    int64_t n = static_cast<int64_t>(chunks_.size());
    if (fns_.empty() && matrix_fns_.empty()) {  // no compiler: the float32 interpreter
      MatrixTables* m = matrix();  // chunks write disjoint rows and column partials
      default_thread_pool().parallel_for(n, [&](int64_t b, int64_t e) {
        run_element_phase<float>(plan_, index, tensors_, chunks_, static_cast<size_t>(b), static_cast<size_t>(e),
                                 table_.data(), groups_, tensor_reductions_, partials_, m);
      });
      return;
    }
    const ScalarLayout& L = plan_.layout;
    phase_partials_.assign(ph.reductions.size() * chunks_.size(), 0.0);
    const double* derived = table_.data() + L.derived_offset(groups_);
    const double* skip = table_.data() + L.skip_offset(groups_);
    const double* steps = table_.data() + L.steps_offset(groups_);
    if (plan_.matrix()) {  // chunks write disjoint rows and column partials
      MatrixPhaseFn fn = matrix_fns_[index];
      MatrixTables& m = matrix_;
      default_thread_pool().parallel_for(n, [&](int64_t b, int64_t e) {
        fn(table_words_.data(), chunks_.data(), b, e, derived, skip, steps, L.derived_per_group, tensor_reductions_.data(),
           L.tensor_reductions, phase_partials_.data(), n, mats_.data(), m.row_reductions.data(), m.col_partials.data(),
           m.row_values.data(), m.col_values.data(), m.matrix_sums.data());
      });
    } else {
      PhaseFn fn = fns_[index];
      default_thread_pool().parallel_for(n, [&](int64_t b, int64_t e) {
        fn(table_words_.data(), chunks_.data(), b, e, derived, skip, steps, L.derived_per_group, tensor_reductions_.data(),
           L.tensor_reductions, phase_partials_.data(), n);
      });
    }
    for (size_t k = 0; k < ph.reductions.size(); ++k) {
      const size_t slot = plan_.reduction_index(ph.reductions[k]);
      std::copy(phase_partials_.begin() + static_cast<std::ptrdiff_t>(k * chunks_.size()),
                phase_partials_.begin() + static_cast<std::ptrdiff_t>((k + 1) * chunks_.size()),
                partials_[slot].begin());
    }
  }

  void run_values(size_t index) override {
    if (values_fns_.empty()) {  // no compiler: the float32 interpreter
      run_values_step<float>(plan_, index, tensors_, table_.data(), groups_, tensor_reductions_, matrix_);
      return;
    }
    // Matrices are independent (their rows, columns and sums are their own): split across threads.
    const ScalarLayout& L = plan_.layout;
    MatrixTables& m = matrix_;
    const double* derived = table_.data() + L.derived_offset(groups_);
    ValuesFn fn = values_fns_[index];
    default_thread_pool().parallel_for(m.layout.matrices, [&](int64_t b, int64_t e) {
      fn(table_words_.data(), mats_.data(), static_cast<long long>(tensors_.size()), m.layout.matrices, b, e, derived,
         L.derived_per_group, tensor_reductions_.data(), L.tensor_reductions, m.row_reductions.data(),
         m.col_reductions.data(), m.row_values.data(), m.col_values.data(), m.matrix_sums.data());
    });
  }

 private:
  // Generates and compiles the source for variants_ (cached on disk by content).
  void compile() {
    std::string source = generate_cpu_source(plan_, variants_);
    host::CompileResult r = host::compile_shared_object(source);
    auto lib = std::make_unique<host::SharedLibrary>(r.so_path);
    std::vector<PhaseFn> fns;
    std::vector<MatrixPhaseFn> matrix_fns;
    std::vector<ValuesFn> values_fns;
    for (size_t i = 0; i < plan_.phases.size(); ++i) {
      void* f = lib->symbol("of_phase" + std::to_string(i));
      if (plan_.matrix()) {
        matrix_fns.push_back(reinterpret_cast<MatrixPhaseFn>(f));
        values_fns.push_back(reinterpret_cast<ValuesFn>(lib->symbol("of_values" + std::to_string(i))));
      } else {
        fns.push_back(reinterpret_cast<PhaseFn>(f));
      }
    }
    source_ = std::move(source);
    lib_ = std::move(lib);
    fns_ = std::move(fns);
    matrix_fns_ = std::move(matrix_fns);
    values_fns_ = std::move(values_fns);
    char buf[200];
    std::snprintf(buf, sizeof buf, "compiled C++ (%s, %.3f s), %d threads, %zu storage variant(s)",
                  r.from_cache ? "cached" : "compiled now", r.seconds, default_thread_count(), variants_.size());
    status_ = buf;
  }

  std::string source_, status_;
  std::vector<StorageVariant> variants_;  // compiled, in OfTensor::variant order
  std::vector<int> variant_index_;        // per tensor
  std::unique_ptr<host::SharedLibrary> lib_;
  std::vector<PhaseFn> fns_;               // a vector plan's phases, or
  std::vector<MatrixPhaseFn> matrix_fns_;  // a matrix plan's
  std::vector<ValuesFn> values_fns_;       // and its Values steps
  std::vector<DeviceMatrix> mats_;         // matrix plans: per tensor, its view and table offsets
  std::vector<uint64_t> table_words_;
  std::vector<ChunkRange> ranges_;        // per tensor, its chunks (for update_pointers)
  std::vector<double> phase_partials_;
};

}  // namespace

std::unique_ptr<Executor> make_cpu_executor(PlanPtr plan) { return std::make_unique<CpuExecutor>(std::move(plan)); }

}  // namespace optfuse
