// The run-time API: an Optimizer owns a plan, its scalars (hyperparameters per group, step counts)
// and a backend executor, and steps a set of tensors whose memory the caller owns.
//
//   optfuse::Optimizer opt(optfuse::adamw({{"lr", 1e-3}}), optfuse::Backend::cpu);
//   opt.set_tensors({optfuse::TensorRef{{p, n, DType::f32}, {g, n, DType::f32}, {{m, n, DType::f32}, {v, n, DType::f32}}}});
//   opt.step();
//
// State buffers are the caller's: fill them with each state's init value (plan().program.states)
// before the first step. For Backend::cuda every pointer is device memory and steps are
// asynchronous on the given stream.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "optfuse/dtype.h"
#include "optfuse/plan.h"

namespace optfuse {

enum class Backend {
  reference,  // the plan interpreted in float64: the ground truth for tests
  cpu,        // generated C++ compiled at run time (interpreted in float32 if no compiler)
  cuda,       // generated CUDA compiled with NVRTC
};
Backend parse_backend(const std::string& name);
const char* backend_name(Backend b);
// Elements per chunk, the unit of work and of partial sums, of each backend: small enough to
// balance CPU threads and CUDA blocks, large enough to amortise a chunk's setup. A sharded tensor's
// pieces start at multiples of it (Optimizer::set_exchange).
int32_t chunk_elements(Backend b);

struct Buffer {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::f32;
  // Stores to this buffer round stochastically (float16/bfloat16 buffers the step writes: the
  // parameter and states); unbiased, so updates far below one ulp survive on average.
  bool stochastic_rounding = false;
};

// One parameter: its gradient and its state slots in the plan's order, all of one size (a Rows or
// Cols state: one value per row or column of the parameter's matrix view). Each role
// has its own dtype (float32, float16 or bfloat16; a fixed-dtype state of the plan's precision
// options has that one); the kernels are specialised on the combination, math is float32.
struct TensorRef {
  Buffer param, grad;
  std::vector<Buffer> states;
  int group = 0;
  // Stochastic rounding's random stream for this tensor: element e draws its bits from
  // (rng_key, rng_offset + e, step, role), so a tensor cut into shards, each with the offset of its
  // first element, rounds exactly as the whole tensor would. Give each tensor its own key (and fold
  // a seed into it); equal keys and offsets mean equal random bits.
  uint64_t rng_key = 0;
  int64_t rng_offset = 0;
  // The tensor's matrix view, for plans with row or column values (Adafactor): the number of
  // columns (a row-major tensor's last dimension), dividing numel. 0: no view; the tensor is then
  // one column of numel rows (a vector's rows are its elements).
  int64_t cols = 0;
  // The rows of each matrix of the view, for tensors of more than 2 dimensions: the view is then a
  // batch of numel / (matrix_rows * cols) matrices, one after another (torch's Adafactor factors
  // the last two dimensions of each). Column values and states are per matrix and column (batch x
  // cols of them), Op::Shape's rows is matrix_rows, and a sum of row or column values is over one
  // matrix. 0: the view is one matrix.
  int64_t matrix_rows = 0;
};

struct StepInputs {
  // Optional float32 scalars (device memory for CUDA): gradients arrive multiplied by *grad_scale;
  // *found_inf != 0 skips the step. Read on the device, so no host synchronisation is needed.
  const float* grad_scale = nullptr;
  const float* found_inf = nullptr;
  void* stream = nullptr;  // CUstream for CUDA (nullptr: the default stream)
};

// A sharded step (ZeRO): each rank's optimizer steps its own pieces of the tensors, and reductions
// must still cover every piece of every rank. The schedule's Exchange step (optfuse/schedule.h)
// hands the caller the per-chunk partial sums of a reduce pass; the caller gathers every rank's
// (all-gather) into the *global* chunk order, and the Combine step then combines them exactly as
// an unsharded optimizer over the whole tensors would: the same chunks in the same order, so a
// sharded step is bitwise equal to the unsharded one. For that, rank pieces must be cut at chunk
// boundaries of their tensors (multiples of chunk_elements() from the tensor's first element), and
// the local tensors' chunks must be, in order, one contiguous range of the global chunks.
struct ChunkSpan {
  int64_t first = 0, count = 0;  // global chunk indices [first, first + count)
};
struct ShardMap {
  int64_t global_chunks = 0;         // chunks of all ranks' tensors, in the unsharded order
  std::vector<ChunkSpan> tensors;    // per local tensor: the chunks of the WHOLE tensor it is a piece of
};
struct PartialSums {
  int phase = 0;                  // the reduce phase (schedule step) that produced them
  std::vector<int> reductions;    // rows this phase produced (Plan::reductions indices); others are stale
  int64_t local_chunks = 0;       // this optimizer's chunks, in its tensor-table order
  const double* local = nullptr;  // [plan.reductions.size()][local_chunks]
  int64_t global_chunks = 0;
  double* global = nullptr;       // [plan.reductions.size()][global_chunks]: the caller fills the rows
  bool on_device = false;         // local and global are device memory (Backend::cuda): enqueue the
                                  // exchange on the step's stream, do not wait for it
};
// Called at every Exchange step (on the host, in the step's call; CUDA work it enqueues on the
// step's stream is ordered before the Combine).
using ExchangeFn = std::function<void(const PartialSums&)>;

class Executor;
struct HyperSource;

// Movable, not copyable. A moved-from Optimizer holds nothing: every call on it throws
// optfuse::Error ("... was moved from"); assigning a live Optimizer to it makes it usable again.
class Optimizer {
 public:
  Optimizer(const Chain& chain, Backend backend, int groups = 1, const Precision& precision = {});
  ~Optimizer();
  Optimizer(Optimizer&&) noexcept;
  Optimizer& operator=(Optimizer&&) noexcept;

  const Plan& plan() const { return *live().plan_; }
  Backend backend() const { return backend_; }
  int num_groups() const { return groups_; }
  // Adds a group with the chain's default hyperparameters; returns its index.
  int add_group();
  // Sets every hyperparameter the name matches (short or qualified) for one group; validated
  // against the rule's range, nothing changes on error. Never recompiles.
  void set_hyper(int group, const std::string& name, double value);
  // set_hyper without the range check: a value torch.optim accepts in param_groups between steps
  // (NaN, inf, a negative lr: torch validates constructor arguments only, and steps with whatever a
  // scheduler or the user sets later). The torch front end pushes group values through it.
  void set_hyper_unchecked(int group, const std::string& name, double value);
  double hyper(int group, const std::string& name) const;
  // Reads the hyperparameter(s) `name` matches of `group` from `value` at every step, instead of the
  // last set_hyper value: a float32 or float64 scalar in device memory for Backend::cuda (read by
  // the kernel, so a change made on the stream before a step, even between replays of a captured
  // CUDA graph, takes effect at that step), host memory otherwise. The memory must stay valid while
  // bound. Bound values are not range-checked (they change where the host cannot see them).
  // value == nullptr unbinds: the last set_hyper value applies again.
  enum class ScalarType { f32, f64 };
  void bind_hyper(int group, const std::string& name, const void* value, ScalarType type = ScalarType::f32);
  // Steps taken so far by a group (reads back from the device for CUDA).
  int64_t step_count(int group) const;
  void set_step_count(int group, int64_t steps);
  // A group's uniform state (Rule::uniform_state; short or qualified name), as the last step that
  // was not skipped left it (reads back from the device for CUDA); a new group's is its init value,
  // and add_group keeps the other groups' values.
  double uniform_state(int group, const std::string& name) const;
  void set_uniform_state(int group, const std::string& name, double value);

  // Validates every tensor (sizes agree, dtypes are ones the roles and the plan's precision options
  // take, state count matches the plan, group exists) and builds the tensor table; throws without
  // changing anything on bad input. A combination of role dtypes not seen before compiles a kernel
  // variant for it (once; cached on disk).
  void set_tensors(const std::vector<TensorRef>& tensors);
  const std::vector<TensorRef>& tensors() const { return tensors_; }
  // Points the tensors at new gradient buffers (one per tensor, same sizes and dtypes as before):
  // the cheap path for frameworks that reallocate gradients between steps. Only pointers change;
  // nothing is revalidated beyond the count and null pointers.
  void set_grad_pointers(const std::vector<const void*>& grads);
  // Points every role at new buffers (same sizes, dtypes and layout as before; the caller vouches for
  // that): params and grads one per tensor, states num_states per tensor in table order. An empty
  // list leaves that role as it is. For callers that are handed the very tensors to update on each
  // step (a torch custom op under functionalization may receive copies of the parameters and
  // states). Like set_grad_pointers: no allocation on the device, no synchronisation.
  void set_pointers(const std::vector<const void*>& params, const std::vector<const void*>& grads,
                    const std::vector<const void*>& states);
  void step(const StepInputs& inputs = {});
  // Elements per chunk of this backend (pieces of a sharded tensor start at multiples of it).
  int32_t chunk_elements() const;
  // Makes every step exchange partial sums through `fn` (see ShardMap): map.tensors has one span
  // per tensor of the current tensor set, each at least as long as that tensor's own chunks.
  // Cleared by set_tensors (a new tensor set needs a new map); an empty fn clears it too.
  void set_exchange(const ShardMap& map, ExchangeFn fn);

  // The generated source the backend runs (empty for the reference backend).
  std::string source() const;
  // A one-line description of how the backend runs (compiled, cached, fallback...).
  std::string backend_status() const;

 private:
  const Optimizer& live() const;  // *this, or throws if moved from
  Optimizer& live();
  void check_group(int group) const;
  void upload_hypers();
  // Shared with the executor, which runs it: the plan's address survives moves of the Optimizer.
  std::shared_ptr<const Plan> plan_;
  Backend backend_;
  int groups_ = 0;
  std::vector<double> hypers_;   // [group][hyper]
  std::vector<HyperSource> hyper_sources_;  // [group][hyper]: where bound values are read
  std::vector<TensorRef> tensors_;
  std::unique_ptr<Executor> exec_;
};

// Fills a state buffer with its init value (host memory only; helper for tests and the CLI).
void fill_host_buffer(const Buffer& b, double value);
// Fills every state of a host tensor with its initial value: the parameter's value for a master
// copy (ProgramState::init_from_param), `init` for the others.
void init_host_states(const Plan& plan, const TensorRef& t);

}  // namespace optfuse
