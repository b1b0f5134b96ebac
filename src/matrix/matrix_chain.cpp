#include "optfuse/matrix_chain.h"

#include <cstdlib>
#include <map>
#include <sstream>
#include <tuple>

#include "optfuse/error.h"
#include "optfuse/schedule.h"
#include "runtime/cuda_api.h"

namespace optfuse {

bool has_matrix_phase(const Chain& chain) {
  for (const Rule& r : chain)
    if (r.matrix_phase()) return true;
  return false;
}

namespace {

// Part 1's last rule: its update becomes the "parameter" (the scratch) exactly: u + (-0.0) == u for
// every u, so part 1's update pass writes the update into the scratch.
Rule store_update_in_scratch() {
  return Rule("store_update_in_scratch").update([](RuleBuilder& b) {
    b.set_param_base(b.update());
    return b.constant(-0.0);
  });
}

// First rule of both parts: a step with found_inf set (GradScaler's inf check) is skipped by both,
// so part 2 never applies a scratch that part 1 did not write.
Rule skip_if_found_inf() {
  return Rule("skip_if_found_inf").update([](RuleBuilder& b) {
    b.skip_step_if(b.global(kFoundInf) != 0.0);
    return b.update();
  });
}

// Refuses rules of `rules` that skip a step on anything but found_inf: a part skipped alone would
// leave the other one applying a stale scratch or a momentum without its update.
void refuse_other_skips(const Chain& rules, const char* where) {
  Chain others;
  for (const Rule& r : rules)
    if (r.name() != "unscale_by_grad_scale") others.push_back(r);  // skips on found_inf only
  if (others.empty()) return;
  const Program program = build_program(others);
  if (program.skip != kNoNode)
    throw Error(std::string("a rule ") + where + " the matrix rule may skip the step (" + program.chain_text +
                "): both parts of a chain with a matrix phase skip together, on found_inf only");
}

// Host memory for the CPU backend's scratch, 64-byte aligned (the generated loops' vectors).
struct HostBlock {
  void* p = nullptr;
  explicit HostBlock(size_t bytes) {
    p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw Error("MatrixChainOptimizer: out of host memory for " + std::to_string(bytes) + " bytes of scratch");
  }
  ~HostBlock() { std::free(p); }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
};

struct Bucket {
  MatrixBatchShape shape;
  std::unique_ptr<NewtonSchulz> ns;
  std::unique_ptr<HostBlock> host;  // cpu
  cuda::DeviceBuffer device;        // cuda
  void* data() const { return host ? host->p : reinterpret_cast<void*>(device.ptr()); }
};

}  // namespace

struct MatrixChainOptimizer::State {
  Backend backend;
  NewtonSchulzOptions options;
  Optimizer before, after;
  std::string matrix_signature;
  std::vector<Bucket> buckets;

  State(Backend b, NewtonSchulzOptions o, const Chain& c1, const Chain& c2, int groups, std::string sig)
      : backend(b), options(o), before(c1, b, groups), after(c2, b, groups), matrix_signature(std::move(sig)) {}
};

MatrixChainParts split_matrix_chain(const Chain& chain) {
  size_t at = chain.size(), count = 0;
  for (size_t i = 0; i < chain.size(); ++i)
    if (chain[i].matrix_phase()) {
      at = i;
      ++count;
    }
  if (count != 1)
    throw Error("a chain with a matrix phase needs exactly one matrix rule (e.g. newton_schulz), this one has " +
                std::to_string(count));
  if (at == 0) throw Error("the matrix rule needs element-wise rules before it (e.g. momentum)");
  if (at + 1 == chain.size()) throw Error("the matrix rule needs rules after it (e.g. the learning rate)");
  const Chain user_before(chain.begin(), chain.begin() + static_cast<long>(at));
  const Chain user_after(chain.begin() + static_cast<long>(at) + 1, chain.end());
  refuse_other_skips(user_before, "before");
  refuse_other_skips(user_after, "after");
  MatrixChainParts p;
  p.before.push_back(skip_if_found_inf());
  p.before.insert(p.before.end(), user_before.begin(), user_before.end());
  p.before.push_back(store_update_in_scratch());
  p.matrix = *chain[at].matrix_phase();
  p.matrix_signature = chain[at].signature();
  p.after.push_back(skip_if_found_inf());
  p.after.insert(p.after.end(), user_after.begin(), user_after.end());
  return p;
}

void check_matrix_chain_part1(const Plan& before) {
  for (const ElementPhase& ph : before.phases)
    if (ph.reads_param)
      throw Error("the rules before the matrix rule read the parameter (" + before.program.chain_text +
                  "); they run on the update alone (put weight decay after the matrix rule)");
}

MatrixChainOptimizer::MatrixChainOptimizer(const Chain& chain, Backend backend, int groups) {
  if (backend == Backend::reference)
    throw Error("MatrixChainOptimizer: the reference backend has no matrix phase (use cpu or cuda)");
  MatrixChainParts parts = split_matrix_chain(chain);
  check_matrix_chain_part1(make_plan(parts.before));  // before compiling anything
  std::string why;
  if (!gemm_available(backend, &why)) throw BackendUnavailable(why);
  s_ = std::make_unique<State>(backend, parts.matrix, parts.before, parts.after, groups, parts.matrix_signature);
}

MatrixChainOptimizer::~MatrixChainOptimizer() = default;
MatrixChainOptimizer::MatrixChainOptimizer(MatrixChainOptimizer&&) noexcept = default;
MatrixChainOptimizer& MatrixChainOptimizer::operator=(MatrixChainOptimizer&&) noexcept = default;

namespace {
[[noreturn]] void moved_from() { throw Error("MatrixChainOptimizer: used after being moved from"); }
}  // namespace

Backend MatrixChainOptimizer::backend() const {
  if (!s_) moved_from();
  return s_->backend;
}
int MatrixChainOptimizer::num_groups() const {
  if (!s_) moved_from();
  return s_->before.num_groups();
}
int MatrixChainOptimizer::add_group() {
  if (!s_) moved_from();
  s_->after.add_group();
  return s_->before.add_group();
}

namespace {
bool has_hyper(const Optimizer& o, const std::string& name) {
  try {
    return !o.plan().program.find_hypers(name).empty();
  } catch (const Error&) {
    return false;
  }
}
}  // namespace

void MatrixChainOptimizer::set_hyper(int group, const std::string& name, double value) {
  if (!s_) moved_from();
  const bool in1 = has_hyper(s_->before, name), in2 = has_hyper(s_->after, name);
  if (!in1 && !in2)
    throw Error("MatrixChainOptimizer: no hyperparameter '" + name + "' in " + s_->before.plan().program.chain_text +
                " or " + s_->after.plan().program.chain_text);
  // validate both before changing either: nothing changes on error
  const double old1 = in1 ? s_->before.hyper(group, name) : 0;
  if (in1) s_->before.set_hyper(group, name, value);
  if (in2) {
    try {
      s_->after.set_hyper(group, name, value);
    } catch (...) {
      if (in1) s_->before.set_hyper(group, name, old1);
      throw;
    }
  }
}

double MatrixChainOptimizer::hyper(int group, const std::string& name) const {
  if (!s_) moved_from();
  return has_hyper(s_->before, name) ? s_->before.hyper(group, name) : s_->after.hyper(group, name);
}

int64_t MatrixChainOptimizer::step_count(int group) const {
  if (!s_) moved_from();
  return s_->after.step_count(group);
}

std::vector<ProgramState> MatrixChainOptimizer::states() const {
  if (!s_) moved_from();
  std::vector<ProgramState> out = s_->before.plan().program.states;
  for (const ProgramState& st : s_->after.plan().program.states) out.push_back(st);
  return out;
}

const NewtonSchulzOptions& MatrixChainOptimizer::matrix_options() const {
  if (!s_) moved_from();
  return s_->options;
}

const Optimizer& MatrixChainOptimizer::part(int i) const {
  if (!s_) moved_from();
  if (i != 0 && i != 1) throw Error("MatrixChainOptimizer::part: 0 (before the matrix phase) or 1 (after it)");
  return i == 0 ? s_->before : s_->after;
}

void MatrixChainOptimizer::set_tensors(const std::vector<TensorRef>& tensors) {
  if (!s_) moved_from();
  State& s = *s_;
  const size_t n1 = s.before.plan().program.states.size(), n2 = s.after.plan().program.states.size();
  // Buckets: same (dtype, rows, cols), in order of first appearance; each tensor's place in its bucket.
  std::map<std::tuple<int, int64_t, int64_t>, size_t> index;
  std::vector<MatrixBatchShape> shapes;
  std::vector<std::pair<size_t, int64_t>> place;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorRef& r = tensors[t];
    if (r.states.size() != n1 + n2)
      throw Error("MatrixChainOptimizer: tensor " + std::to_string(t) + " has " + std::to_string(r.states.size()) +
                  " states, the chain has " + std::to_string(n1 + n2) + " (states() lists them)");
    if (r.cols <= 0 || r.param.numel % r.cols != 0)
      throw Error("MatrixChainOptimizer: tensor " + std::to_string(t) + " needs a matrix view (TensorRef::cols > 0 "
                  "dividing its " + std::to_string(r.param.numel) + " elements): the matrix phase works on 2-D matrices");
    const int64_t rows = r.param.numel / r.cols;
    auto key = std::make_tuple(static_cast<int>(r.param.dtype), rows, r.cols);
    auto [it, added] = index.emplace(key, shapes.size());
    if (added) shapes.push_back({r.param.dtype, 0, rows, r.cols});
    place.emplace_back(it->second, shapes[it->second].batch * rows * r.cols);
    ++shapes[it->second].batch;
  }
  // The same buckets as before (new gradients, same shapes): keep their scratch and work buffers, so
  // a training loop that calls set_tensors every step allocates nothing.
  bool same = shapes.size() == s.buckets.size();
  for (size_t b = 0; same && b < shapes.size(); ++b) {
    const MatrixBatchShape& o = s.buckets[b].shape;
    same = o.dtype == shapes[b].dtype && o.batch == shapes[b].batch && o.rows == shapes[b].rows && o.cols == shapes[b].cols;
  }
  std::vector<Bucket> buckets(same ? 0 : shapes.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets[b].shape = shapes[b];
    buckets[b].ns = std::make_unique<NewtonSchulz>(s.backend, shapes[b], s.options);
    const size_t bytes = static_cast<size_t>(shapes[b].numel()) * dtype_size(shapes[b].dtype);
    if (s.backend == Backend::cuda) buckets[b].device = cuda::DeviceBuffer(bytes);
    else buckets[b].host = std::make_unique<HostBlock>(bytes);
  }
  const std::vector<Bucket>& use = same ? s.buckets : buckets;
  std::vector<TensorRef> first, second;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorRef& r = tensors[t];
    const Bucket& bk = use[place[t].first];
    Buffer scratch{static_cast<char*>(bk.data()) + place[t].second * static_cast<int64_t>(dtype_size(bk.shape.dtype)),
                   r.param.numel, r.param.dtype};
    TensorRef a = r, b = r;
    a.param = scratch;  // part 1 writes its update here
    a.states.assign(r.states.begin(), r.states.begin() + static_cast<long>(n1));
    b.grad = scratch;   // part 2 reads it as its gradient
    b.states.assign(r.states.begin() + static_cast<long>(n1), r.states.end());
    first.push_back(a);
    second.push_back(b);
  }
  // Each part changes nothing when it refuses its tensors; part 1 goes back to its old ones when
  // part 2 refuses (its new scratch would be freed with `buckets`).
  const std::vector<TensorRef> old_first = s.before.tensors();
  s.before.set_tensors(first);
  try {
    s.after.set_tensors(second);
  } catch (...) {
    s.before.set_tensors(old_first);
    throw;
  }
  if (!same) s.buckets = std::move(buckets);
}

void MatrixChainOptimizer::set_grad_pointers(const std::vector<const void*>& grads) {
  if (!s_) moved_from();
  s_->before.set_grad_pointers(grads);  // only part 1 reads the gradients
}

void MatrixChainOptimizer::step(const StepInputs& inputs) {
  if (!s_) moved_from();
  State& s = *s_;
  s.before.step(inputs);
  for (Bucket& b : s.buckets) b.ns->run(b.data(), inputs.stream);
  StepInputs second = inputs;
  second.grad_scale = nullptr;  // the scratch is not scaled; found_inf skips this part too (skip_if_found_inf)
  s.after.step(second);
}

std::string MatrixChainOptimizer::describe() const {
  if (!s_) moved_from();
  const State& s = *s_;
  std::ostringstream o;
  o << "part 1: " << s.before.plan().program.chain_text << "\n" << describe_schedule(s.before.plan())
    << "  (part 1's parameter role is each tensor's scratch matrix: its update pass writes the update there)\n"
    << "matrix: " << s.matrix_signature
    << ": per tensor, bf16 Newton-Schulz of the scratch matrix (transposed if tall), batched over same-shape matrices"
    << (s.backend == Backend::cuda ? " (cuBLAS strided-batched GEMMs)" : " (OpenBLAS sgemm on bf16 values)") << "\n";
  for (const Bucket& b : s.buckets)
    o << "  " << b.shape.batch << " x " << b.shape.rows << "x" << b.shape.cols << " " << dtype_name(b.shape.dtype)
      << ": " << b.ns->flops() / 1e9 << " GFLOP per step\n";
  o << "part 2: " << s.after.plan().program.chain_text << "\n" << describe_schedule(s.after.plan())
    << "  (part 2's gradient role is the orthogonalised scratch)\n";
  return o.str();
}

}  // namespace optfuse
