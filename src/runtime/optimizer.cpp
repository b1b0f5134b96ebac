#include "optfuse/optimizer.h"

#include <climits>
#include <sstream>

#include "optfuse/error.h"
#include "runtime/executor.h"
#include "runtime/matrix_tables.h"

namespace optfuse {

Backend parse_backend(const std::string& name) {
  if (name == "reference") return Backend::reference;
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("unknown backend '" + name + "' (expected reference, cpu or cuda)");
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::reference: return "reference";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

Optimizer::Optimizer(const Chain& chain, Backend backend, int groups, const Precision& precision)
    : plan_(std::make_shared<const Plan>(make_plan(chain, precision))), backend_(backend) {
  if (groups < 1) throw Error("an optimizer needs at least one parameter group");
  switch (backend) {
    case Backend::reference: exec_ = make_reference_executor(plan_); break;
    case Backend::cpu: exec_ = make_cpu_executor(plan_); break;
    case Backend::cuda: exec_ = make_cuda_executor(plan_); break;
  }
  for (int g = 0; g < groups; ++g) add_group();
}

Optimizer::~Optimizer() = default;

// Moves leave the source empty (no plan, no executor, no tensors), so that using it is a clear
// error rather than a step over state it no longer owns.
Optimizer::Optimizer(Optimizer&& o) noexcept
    : plan_(std::move(o.plan_)), backend_(o.backend_), groups_(o.groups_), hypers_(std::move(o.hypers_)),
      hyper_sources_(std::move(o.hyper_sources_)), tensors_(std::move(o.tensors_)), exec_(std::move(o.exec_)) {
  o.groups_ = 0;
  o.hypers_.clear();
  o.hyper_sources_.clear();
  o.tensors_.clear();
}

Optimizer& Optimizer::operator=(Optimizer&& o) noexcept {
  if (this != &o) {
    plan_ = std::move(o.plan_);
    backend_ = o.backend_;
    groups_ = o.groups_;
    hypers_ = std::move(o.hypers_);
    hyper_sources_ = std::move(o.hyper_sources_);
    tensors_ = std::move(o.tensors_);
    exec_ = std::move(o.exec_);
    o.groups_ = 0;
    o.hypers_.clear();
    o.hyper_sources_.clear();
    o.tensors_.clear();
  }
  return *this;
}

const Optimizer& Optimizer::live() const {
  if (!exec_) throw Error("this optfuse::Optimizer was moved from; use the Optimizer it was moved to");
  return *this;
}
Optimizer& Optimizer::live() {
  if (!exec_) throw Error("this optfuse::Optimizer was moved from; use the Optimizer it was moved to");
  return *this;
}

int Optimizer::add_group() {
  live();
  exec_->resize_groups(groups_ + 1);
  for (const auto& h : plan_->program.hypers) hypers_.push_back(h.value);
  hyper_sources_.resize(hypers_.size());
  exec_->write_hyper_sources(hyper_sources_);
  ++groups_;
  upload_hypers();
  return groups_ - 1;
}

void Optimizer::check_group(int group) const {
  live();
  if (group < 0 || group >= groups_)
    throw Error("parameter group " + std::to_string(group) + " does not exist (there are " +
                std::to_string(groups_) + ")");
}

void Optimizer::upload_hypers() { exec_->write_hypers(hypers_); }

void Optimizer::set_hyper(int group, const std::string& name, double value) {
  check_group(group);
  std::vector<int> slots = plan_->program.find_hypers(name);
  for (int s : slots) {
    const ProgramHyper& h = plan_->program.hypers[static_cast<size_t>(s)];
    if (!h.range.contains(value)) {
      std::ostringstream v;
      v << value;
      throw Error("invalid " + h.name + "=" + v.str() + " for " + h.rule + ": must be " + h.range.describe());
    }
  }
  size_t per = plan_->program.hypers.size();
  for (int s : slots) hypers_[static_cast<size_t>(group) * per + static_cast<size_t>(s)] = value;
  upload_hypers();
}

void Optimizer::set_hyper_unchecked(int group, const std::string& name, double value) {
  check_group(group);
  std::vector<int> slots = plan_->program.find_hypers(name);
  size_t per = plan_->program.hypers.size();
  for (int s : slots) hypers_[static_cast<size_t>(group) * per + static_cast<size_t>(s)] = value;
  upload_hypers();
}

double Optimizer::hyper(int group, const std::string& name) const {
  check_group(group);
  int s = plan_->program.find_hypers(name).front();
  return hypers_[static_cast<size_t>(group) * plan_->program.hypers.size() + static_cast<size_t>(s)];
}

void Optimizer::bind_hyper(int group, const std::string& name, const void* value, ScalarType type) {
  check_group(group);
  std::vector<int> slots = plan_->program.find_hypers(name);
  size_t per = plan_->program.hypers.size();
  for (int s : slots) {
    HyperSource& src = hyper_sources_[static_cast<size_t>(group) * per + static_cast<size_t>(s)];
    src.ptr = reinterpret_cast<uint64_t>(value);
    src.type = type == ScalarType::f64 ? 1 : 0;
  }
  exec_->write_hyper_sources(hyper_sources_);
  if (value == nullptr) upload_hypers();  // the table's value may have been overwritten by the bound one
}

int64_t Optimizer::step_count(int group) const {
  check_group(group);
  return exec_->read_step(group);
}

void Optimizer::set_step_count(int group, int64_t steps) {
  check_group(group);
  if (steps < 0) throw Error("a step count cannot be negative");
  exec_->write_step(group, steps);
}

double Optimizer::uniform_state(int group, const std::string& name) const {
  check_group(group);
  return exec_->read_uniform_state(group, plan_->program.find_uniform_state(name));
}

void Optimizer::set_uniform_state(int group, const std::string& name, double value) {
  check_group(group);
  exec_->write_uniform_state(group, plan_->program.find_uniform_state(name), value);
}

namespace {

void check_buffer(const std::string& where, const std::string& what, const Buffer& b, const Buffer& param) {
  if (b.numel != param.numel)
    throw Error(where + what + " has " + std::to_string(b.numel) + " elements but the parameter has " +
                std::to_string(param.numel));
  if (b.numel > 0 && b.data == nullptr) throw Error(where + what + " has no data pointer");
}

// The dtype rules of one role: float types everywhere, a fixed dtype where the plan says so;
// stochastic rounding only on low-precision buffers the step writes.
void check_dtype(const std::string& where, const std::string& what, const Buffer& b, bool written,
                 const ProgramState* state) {
  if (state != nullptr && state->fixed_dtype) {
    if (b.dtype != state->dtype)
      throw Error(where + what + " must be " + dtype_name(state->dtype) + ", got " + dtype_name(b.dtype));
  } else if (b.dtype == DType::i16) {
    throw Error(where + what + " is int16; only a master-weight remainder state is stored as int16 "
                "(float32, float16 or bfloat16 expected)");
  } else if (b.dtype == DType::q8 && (state == nullptr || state->shape != StateShape::Full)) {
    throw Error(where + what + " is q8; block-quantized 8-bit storage is for a rule's full-size states, not " +
                (state == nullptr ? std::string("parameters or gradients") : "per-row or per-column states"));
  }
  if (b.stochastic_rounding && b.dtype == DType::q8)
    throw Error(where + what + ": q8 states round to the nearest code; stochastic rounding is not offered for them");
  if (b.stochastic_rounding && !(written && dtype_is_low_precision_float(b.dtype)))
    throw Error(where + what + ": stochastic rounding applies to float16/bfloat16 buffers the step writes "
                "(the parameter and states), not to a " + std::string(dtype_name(b.dtype)) + " " +
                (written ? "buffer" : "gradient"));
}

void check_precision(const std::string& where, const Precision& prec, const Buffer& param) {
  if (prec.master == MasterWeights::copy && !dtype_is_low_precision_float(param.dtype))
    throw Error(where + "master weights keep a float32 copy of float16/bfloat16 parameters; this parameter is " +
                dtype_name(param.dtype) + " (step it without master weights)");
  if (prec.master == MasterWeights::remainders && param.dtype != DType::bf16)
    throw Error(where + "master-weight remainders rebuild a float32 master from a bfloat16 parameter; this "
                "parameter is " + dtype_name(param.dtype));
  if (prec.kahan && param.dtype != prec.kahan_dtype)
    throw Error(where + "the chain's kahan compensation is for " + dtype_name(prec.kahan_dtype) +
                " parameters; this parameter is " + dtype_name(param.dtype));
}

}  // namespace

void Optimizer::set_tensors(const std::vector<TensorRef>& tensors) {
  live();
  const Program& prog = plan_->program;
  size_t nstates = prog.states.size();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorRef& r = tensors[t];
    const std::string where = "tensor " + std::to_string(t) + ": ";
    if (r.param.numel < 0) throw Error(where + "negative element count");
    if (r.param.numel > 0 && r.param.data == nullptr) throw Error(where + "parameter has no data pointer");
    check_dtype(where, "parameter", r.param, true, nullptr);
    check_buffer(where, "gradient", r.grad, r.param);
    check_dtype(where, "gradient", r.grad, false, nullptr);
    if (r.cols < 0 || (r.cols > 0 && r.param.numel % r.cols != 0))
      throw Error(where + "a matrix view of " + std::to_string(r.cols) + " columns does not divide its " +
                  std::to_string(r.param.numel) + " elements");
    if (r.matrix_rows < 0 || (r.matrix_rows > 0 && (r.cols == 0 || (r.param.numel / r.cols) % r.matrix_rows != 0)))
      throw Error(where + "matrices of " + std::to_string(r.matrix_rows) + " rows do not divide its " +
                  (r.cols == 0 ? std::string("view (a batch of matrices needs cols > 0)")
                               : std::to_string(r.param.numel / r.cols) + " rows of " + std::to_string(r.cols) + " columns"));
    if (r.states.size() != nstates)
      throw Error(where + std::to_string(r.states.size()) + " state buffers given but the chain has " +
                  std::to_string(nstates));
    for (size_t s = 0; s < nstates; ++s) {
      const std::string what = "state " + prog.states[s].qualified;
      if (prog.states[s].shape == StateShape::Full) {
        check_buffer(where, what, r.states[s], r.param);
      } else {  // one value per row or column of the matrix view
        const int64_t want = state_numel(r, prog.states[s].shape);
        if (r.states[s].numel != want)
          throw Error(where + what + " holds one value per " + (prog.states[s].shape == StateShape::Rows ? "row" : "column") + " of the " +
                      describe_view(r) + ": " + std::to_string(want) + " elements, got " + std::to_string(r.states[s].numel));
        // (an empty parameter's are never read or written: torch gives them no storage)
        if (want > 0 && r.param.numel > 0 && r.states[s].data == nullptr) throw Error(where + what + " has no data pointer");
        if (r.states[s].stochastic_rounding)
          throw Error(where + what + ": stochastic rounding is for full-size states, not per-row or per-column ones");
      }
      check_dtype(where, what, r.states[s], true, &prog.states[s]);
    }
    for (size_t s = 0; s < nstates && plan_->matrix(); ++s)
      if (r.states[s].dtype == DType::q8)
        throw Error(where + "state " + prog.states[s].qualified + " is q8, which plans with row or column values (" +
                    prog.chain_text + ") do not support yet: their chunks hold whole rows, not whole blocks");
    check_precision(where, prog.precision, r.param);
    if (r.group < 0 || r.group >= groups_)
      throw Error(where + "parameter group " + std::to_string(r.group) + " does not exist (there are " +
                  std::to_string(groups_) + ")");
  }
  exec_->set_tensors(tensors);
  exec_->set_exchange({}, nullptr);  // its map described the previous tensor set
  tensors_ = tensors;
}

void Optimizer::set_grad_pointers(const std::vector<const void*>& grads) {
  live();
  if (grads.size() != tensors_.size())
    throw Error("set_grad_pointers: " + std::to_string(grads.size()) + " gradients given for " +
                std::to_string(tensors_.size()) + " tensors");
  for (size_t t = 0; t < grads.size(); ++t)
    if (grads[t] == nullptr && tensors_[t].param.numel > 0)
      throw Error("set_grad_pointers: tensor " + std::to_string(t) + " has no gradient pointer");
  // In place (validated above): this is the per-step path of frameworks that reallocate gradients.
  std::vector<void*> old(grads.size());
  for (size_t t = 0; t < grads.size(); ++t) {
    old[t] = tensors_[t].grad.data;
    tensors_[t].grad.data = const_cast<void*>(grads[t]);
  }
  try {
    exec_->update_grad_pointers(tensors_);
  } catch (...) {
    for (size_t t = 0; t < grads.size(); ++t) tensors_[t].grad.data = old[t];
    throw;
  }
}

void Optimizer::set_pointers(const std::vector<const void*>& params, const std::vector<const void*>& grads,
                             const std::vector<const void*>& states) {
  live();
  const size_t n = tensors_.size(), ns = plan_->program.states.size();
  if ((!params.empty() && params.size() != n) || (!grads.empty() && grads.size() != n) ||
      (!states.empty() && states.size() != n * ns))
    throw Error("set_pointers: " + std::to_string(params.size()) + " parameters, " + std::to_string(grads.size()) +
                " gradients and " + std::to_string(states.size()) + " states given for " + std::to_string(n) +
                " tensors of " + std::to_string(ns) + " states");
  for (size_t t = 0; t < n; ++t) {
    if (tensors_[t].param.numel == 0) continue;
    bool null = (!params.empty() && params[t] == nullptr) || (!grads.empty() && grads[t] == nullptr);
    for (size_t s = 0; !states.empty() && s < ns; ++s) null = null || states[t * ns + s] == nullptr;
    if (null) throw Error("set_pointers: tensor " + std::to_string(t) + " has a null pointer");
  }
  std::vector<TensorRef> old = tensors_;
  for (size_t t = 0; t < n; ++t) {
    if (!params.empty()) tensors_[t].param.data = const_cast<void*>(params[t]);
    if (!grads.empty()) tensors_[t].grad.data = const_cast<void*>(grads[t]);
    for (size_t s = 0; !states.empty() && s < ns; ++s) tensors_[t].states[s].data = const_cast<void*>(states[t * ns + s]);
  }
  try {
    exec_->update_pointers(tensors_);
  } catch (...) {
    tensors_ = std::move(old);
    throw;
  }
}

void Optimizer::step(const StepInputs& inputs) { live().exec_->step(inputs); }
int32_t Optimizer::chunk_elements() const { return live().exec_->chunk_elements(); }

// CUDA: one chunk is the unit of work of one block, so it must be small enough that a single huge
// tensor gives every SM many chunks (2^31 elements -> 131072 chunks) and large enough that the
// per-chunk overhead (descriptor and derived loads, a block reduction) is amortised over several
// passes of the block; 2000 tensors of 4096 elements are one chunk each. A multiple of 8, so every
// chunk of a tensor starts at the tensor's own offset from a 16-byte boundary for every dtype (the
// vector path's condition is then the same for all chunks of a tensor). CPU: small enough to
// balance threads. Reference: only its result matters.
int32_t chunk_elements(Backend b) {
  switch (b) {
    case Backend::reference: return 65536;
    case Backend::cpu: return 16384;
    case Backend::cuda: return 16384;
  }
  return 16384;
}

void Optimizer::set_exchange(const ShardMap& map, ExchangeFn fn) {
  live();
  if (!fn) return exec_->set_exchange({}, nullptr);
  const std::string where = "set_exchange: ";
  if (plan_->matrix())
    throw Error(where + "plans with row or column values (" + plan_->program.chain_text +
                ") cannot be sharded yet: their chunks hold whole rows and their column sums are not exchanged");
  if (map.tensors.size() != tensors_.size())
    throw Error(where + std::to_string(map.tensors.size()) + " chunk spans given for " + std::to_string(tensors_.size()) +
                " tensors (call it after set_tensors)");
  if (map.global_chunks < 0 || map.global_chunks > INT32_MAX)
    throw Error(where + "global_chunks must be in [0, 2^31), got " + std::to_string(map.global_chunks));
  const int64_t chunk = exec_->chunk_elements();
  int64_t local = 0;
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const ChunkSpan& sp = map.tensors[t];
    const int64_t own = (tensors_[t].param.numel + chunk - 1) / chunk;
    local += own;
    if (sp.first < 0 || sp.count < own || sp.first + sp.count > map.global_chunks)
      throw Error(where + "tensor " + std::to_string(t) + " (" + std::to_string(own) + " chunk(s)) has the span [" +
                  std::to_string(sp.first) + ", " + std::to_string(sp.first + sp.count) + ") of " +
                  std::to_string(map.global_chunks) + " global chunks: a span covers the whole tensor it is a piece of");
  }
  if (local > map.global_chunks)
    throw Error(where + "this optimizer has " + std::to_string(local) + " chunks, more than the " +
                std::to_string(map.global_chunks) + " global ones");
  exec_->set_exchange(map, std::move(fn));
}
std::string Optimizer::source() const { return live().exec_->source(); }
std::string Optimizer::backend_status() const { return live().exec_->status(); }

void fill_host_buffer(const Buffer& b, double value) {
  for (int64_t i = 0; i < b.numel; ++i) store_element(b.data, b.dtype, i, value);
}

void init_host_states(const Plan& plan, const TensorRef& t) {
  for (size_t s = 0; s < t.states.size() && s < plan.program.states.size(); ++s) {
    const ProgramState& st = plan.program.states[s];
    const Buffer& b = t.states[s];
    if (!st.init_from_param) {
      fill_host_buffer(b, st.init);
      continue;
    }
    for (int64_t i = 0; i < b.numel; ++i) store_element(b.data, b.dtype, i, load_element(t.param.data, t.param.dtype, i));
  }
}

}  // namespace optfuse
