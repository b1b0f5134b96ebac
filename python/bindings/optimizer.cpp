// The Optimizer binding (DLPack arrays or raw pointers from the torch front end).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <optional>
#include <sstream>

#include "codegen/cpu_source.h"
#include "codegen/cuda_source.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/ir.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "optfuse/rule.h"
#include "runtime/matrix_tables.h"

#include "bindings/arrays.h"
#include "bindings/common.h"
#include "bindings/dlpack_exchange.h"

using namespace nb::literals;

namespace optfuse::py {

namespace {

// ---------------------------------------------------------------------------------------------
// Optimizer. The C++ Optimizer keeps raw pointers; the wrapper keeps what owns the memory alive
// (the DLPack arrays, or nothing for the raw path whose caller keeps its tensors) and checks that
// every tensor lives where the backend runs.

class PyOptimizer {
 public:
  PyOptimizer(nb::handle chain, const std::string& backend, int groups, const std::string& master_weights,
              nb::handle kahan) {
    Chain c = to_chain(chain);
    Backend b = parse_backend(backend);
    Precision prec;
    if (master_weights == "copy" || master_weights == "true") prec.master = MasterWeights::copy;
    else if (master_weights == "remainders") prec.master = MasterWeights::remainders;
    else if (master_weights != "none" && master_weights != "false")
      throw Error("master_weights must be 'none', 'copy' or 'remainders', got '" + master_weights + "'");
    if (!kahan.is_none()) {
      prec.kahan = true;
      prec.kahan_dtype = parse_dtype(nb::cast<std::string>(kahan));
    }
    nb::gil_scoped_release release;  // compiling can take a while; Python update functions re-take the GIL
    opt_ = std::make_unique<Optimizer>(c, b, groups, prec);
  }

  Optimizer& get() { return *opt_; }
  bool on_cuda() const { return opt_->backend() == Backend::cuda; }

  // (param, grad, [states], group) per tensor, each an array with DLPack. stochastic_rounding: the
  // low-precision float buffers the step writes round stochastically; tensor t's random stream
  // is keyed on (rng_seed << 32) ^ t.
  void set_tensors(nb::handle items, bool stochastic_rounding, uint64_t rng_seed) {
    const auto& states = opt_->plan().program.states;
    std::vector<TensorRef> refs;
    std::vector<nb::object> keep;
    int dev_id = -1;
    size_t t = 0;
    for (nb::handle item : items) {
      TensorRef r = read_tensor_item(item, "tensor " + std::to_string(t), states, opt_->backend(), dev_id, keep);
      if (stochastic_rounding) {
        r.param.stochastic_rounding = dtype_is_low_precision_float(r.param.dtype);
        for (Buffer& b : r.states) b.stochastic_rounding = dtype_is_low_precision_float(b.dtype);
      }
      r.rng_key = (rng_seed << 32) ^ static_cast<uint64_t>(t);
      refs.push_back(r);
      ++t;
    }
    opt_->set_tensors(refs);  // validates groups, counts; changes nothing on error
    keep_ = std::move(keep);
    device_id_ = dev_id;
  }

  // The torch front end's path: pointers checked on the Python side (contiguous, dtype, device,
  // sizes), which keeps the tensors alive. states holds num_states pointers per tensor; dtypes and
  // stochastic hold one entry per role (param, grad, states) per tensor (stochastic may be empty:
  // none); rng_keys / rng_offsets one per tensor (or empty: 0).
  void set_tensors_raw(const std::vector<uint64_t>& params, const std::vector<uint64_t>& grads,
                       const std::vector<uint64_t>& states, const std::vector<int64_t>& numels,
                       const std::vector<int>& dtypes, const std::vector<int>& groups, int device_id,
                       const std::vector<int64_t>& watch_indices, const std::vector<bool>& stochastic,
                       const std::vector<uint64_t>& rng_keys, const std::vector<int64_t>& rng_offsets,
                       const std::vector<int64_t>& cols, const std::vector<int64_t>& matrix_rows) {
    size_t n = params.size(), ns = opt_->plan().program.states.size(), roles = 2 + ns;
    if (grads.size() != n || numels.size() != n || dtypes.size() != n * roles || groups.size() != n ||
        states.size() != n * ns || (!watch_indices.empty() && watch_indices.size() != n) ||
        (!stochastic.empty() && stochastic.size() != n * roles) || (!rng_keys.empty() && rng_keys.size() != n) ||
        (!rng_offsets.empty() && rng_offsets.size() != n) || (!cols.empty() && cols.size() != n) ||
        (!matrix_rows.empty() && matrix_rows.size() != n))
      throw Error("_set_tensors_raw: inconsistent list lengths");
    const auto& specs = opt_->plan().program.states;
    std::vector<TensorRef> refs(n);
    for (size_t i = 0; i < n; ++i) {
      if (!cols.empty()) refs[i].cols = cols[i];
      if (!matrix_rows.empty()) refs[i].matrix_rows = matrix_rows[i];
      auto buf = [&](uint64_t ptr, size_t role) {
        int code = dtypes[i * roles + role];
        if (code < 0 || code >= kNumDTypes) throw Error("_set_tensors_raw: bad dtype code " + std::to_string(code));
        // A Rows / Cols state holds one value per row / column of the matrix view (set_tensors checks it)
        const int64_t numel = role < 2 ? numels[i] : state_numel(refs[i], specs[role - 2].shape);  // (param set first)
        return Buffer{reinterpret_cast<void*>(ptr), numel, static_cast<DType>(code),
                      !stochastic.empty() && stochastic[i * roles + role]};
      };
      refs[i].param = buf(params[i], 0);
      refs[i].grad = buf(grads[i], 1);
      for (size_t s = 0; s < ns; ++s) refs[i].states.push_back(buf(states[i * ns + s], 2 + s));
      refs[i].group = groups[i];
      if (!rng_keys.empty()) refs[i].rng_key = rng_keys[i];
      if (!rng_offsets.empty()) refs[i].rng_offset = rng_offsets[i];
    }
    opt_->set_tensors(refs);
    keep_.clear();
    device_id_ = device_id;
    watch_indices_ = watch_indices;
  }

  // Grad pointers of the table's tensors from a GradWatch (watch_indices[k]: the watch slot of
  // tensor k, given to set_tensors_raw). Only pointers change (Optimizer::set_grad_pointers: no
  // allocation on the device, no synchronisation), and only when one moved.
  bool take_grads(const std::vector<uint64_t>& ptrs) {
    const std::vector<int64_t>& indices = watch_indices_;
    const std::vector<TensorRef>& cur = opt_->tensors();
    if (indices.size() != cur.size()) throw Error("_take_grads: the index list does not match the tensor table");
    bool moved = false;
    grads_.resize(cur.size());
    for (size_t k = 0; k < cur.size(); ++k) {
      grads_[k] = reinterpret_cast<const void*>(ptrs.at(static_cast<size_t>(indices[k])));
      moved = moved || grads_[k] != cur[k].grad.data;
    }
    if (!moved) return false;
    opt_->set_grad_pointers(grads_);
    return true;
  }

  // The torch custom op's path: the tensors to update this step, in table order (params and grads
  // one per tensor, states num_states per tensor; grads None: kept as they are). Each tensor's
  // data_ptr() is read and the table is re-pointed (Optimizer::set_pointers: no allocation, no
  // synchronisation) when any pointer differs from the table's. Returns whether one did.
  bool patch_pointers(nb::handle params, nb::handle grads, nb::handle states) {
    const std::vector<TensorRef>& cur = opt_->tensors();
    const size_t n = cur.size(), ns = opt_->plan().program.states.size();
    auto read = [&](nb::handle seq, size_t expect, const char* what, std::vector<const void*>& out) {
      out.clear();
      if (seq.is_none()) return;
      nb::object fast = nb::steal(PySequence_Fast(seq.ptr(), "_patch_pointers: expected a sequence of tensors"));
      if (!fast.is_valid()) throw nb::python_error();
      const Py_ssize_t len = PySequence_Fast_GET_SIZE(fast.ptr());
      if (static_cast<size_t>(len) != expect)
        throw Error(std::string("_patch_pointers: ") + std::to_string(len) + " " + what + " given for a table of " +
                    std::to_string(expect));
      PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
      out.resize(expect);
      for (Py_ssize_t i = 0; i < len; ++i) {
        PyObject* ptr = PyObject_CallMethodNoArgs(items[i], name_data_ptr_.ptr());
        if (!ptr) throw nb::python_error();
        out[static_cast<size_t>(i)] = reinterpret_cast<const void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(ptr)));
        Py_DECREF(ptr);
        if (PyErr_Occurred()) throw nb::python_error();
      }
    };
    if (!name_data_ptr_.is_valid()) name_data_ptr_ = nb::steal(PyUnicode_InternFromString("data_ptr"));
    read(params, n, "parameters", p_);
    read(grads, n, "gradients", g_);
    read(states, n * ns, "states", s_);
    bool moved = false;
    for (size_t t = 0; t < n && !moved; ++t) {
      moved = (!p_.empty() && p_[t] != cur[t].param.data) || (!g_.empty() && g_[t] != cur[t].grad.data);
      for (size_t s = 0; !moved && !s_.empty() && s < ns; ++s) moved = s_[t * ns + s] != cur[t].states[s].data;
    }
    if (moved) opt_->set_pointers(p_, g_, s_);
    return moved;
  }

  // The hyperparameter `name` of `group` read at every step from a one-element float32/float64
  // tensor at `ptr` (on the backend's device; 0 unbinds). The caller keeps the tensor alive.
  void bind_hyper_raw(int group, const std::string& name, uint64_t ptr, bool is_f64) {
    opt_->bind_hyper(group, name, reinterpret_cast<const void*>(ptr),
                     is_f64 ? Optimizer::ScalarType::f64 : Optimizer::ScalarType::f32);
  }

  // grad_scale / found_inf: None, a one-element float32 array on the backend's device, or (host
  // backends only) a Python number.
  void step(nb::handle grad_scale, nb::handle found_inf, nb::handle stream) {
    StepInputs in;
    in.grad_scale = scalar(grad_scale, "grad_scale", scale_value_);
    in.found_inf = scalar(found_inf, "found_inf", inf_value_);
    if (!stream.is_none()) {
      if (!on_cuda()) throw Error("step(stream=...) is for the cuda backend");
      in.stream = reinterpret_cast<void*>(nb::cast<uint64_t>(stream));
    }
    nb::gil_scoped_release release;
    opt_->step(in);
  }

  void step_raw(uint64_t grad_scale, uint64_t found_inf, uint64_t stream) {
    StepInputs in;
    in.grad_scale = reinterpret_cast<const float*>(grad_scale);
    in.found_inf = reinterpret_cast<const float*>(found_inf);
    in.stream = reinterpret_cast<void*>(stream);
    {
      nb::gil_scoped_release release;
      opt_->step(in);
    }
    ++steps_taken_;  // (in the same C call as the launch: no KeyboardInterrupt between them)
  }

  int64_t steps_taken() const { return steps_taken_; }

  int device_id() const { return device_id_; }

  // A sharded step's exchange (Optimizer::set_exchange): fn(phase, rows, local, global) is called at
  // every Exchange step with the partials as torch tensors viewing the executor's memory (valid
  // during the call only): local [reductions][local chunks], global [reductions][global chunks],
  // which fn fills (rows: the rows this phase produced). fn=None clears it.
  void set_exchange(int64_t global_chunks, const std::vector<int64_t>& firsts, const std::vector<int64_t>& counts,
                    nb::object fn) {
    if (fn.is_none()) return opt_->set_exchange({}, nullptr);
    if (firsts.size() != counts.size()) throw Error("_set_exchange: firsts and counts differ in length");
    ShardMap map;
    map.global_chunks = global_chunks;
    for (size_t t = 0; t < firsts.size(); ++t) map.tensors.push_back({firsts[t], counts[t]});
    const size_t rows = opt_->plan().reductions.size();
    const int dev = device_id_;
    auto held = std::make_shared<nb::object>(fn);
    opt_->set_exchange(map, [held, rows, dev](const PartialSums& ps) {
      nb::gil_scoped_acquire gil;  // step() runs without the GIL
      auto view = [&](const double* data, int64_t cols) {
        size_t shape[2] = {rows, static_cast<size_t>(cols)};
        return nb::ndarray<nb::pytorch, double, nb::ndim<2>>(const_cast<double*>(data), 2, shape, nb::handle(), nullptr,
                                                              nb::dtype<double>(),
                                                              ps.on_device ? nb::device::cuda::value : nb::device::cpu::value,
                                                              ps.on_device ? dev : 0);
      };
      // rv_policy::reference: views of the executor's memory (the default would copy an array that
      // has no owner, and the caller's writes to `global` would be lost)
      (*held)(ps.phase, ps.reductions, nb::cast(view(ps.local, ps.local_chunks), nb::rv_policy::reference),
              nb::cast(view(ps.global, ps.global_chunks), nb::rv_policy::reference));
    });
  }

 private:
  const float* scalar(nb::handle h, const char* what, float& host_value) {
    if (h.is_none()) return nullptr;
    if (is_number(h)) {
      if (on_cuda()) throw Error(std::string(what) + " must be a one-element float32 CUDA tensor for the cuda backend");
      host_value = static_cast<float>(nb::cast<double>(h));
      return &host_value;
    }
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(h, a, false)) throw Error(std::string(what) + ": expected None, a number or a one-element float32 array, got " + type_name_of(h));
    if (a.size() != 1 || to_dtype(a.dtype()) != DType::f32)
      throw Error(std::string(what) + " must hold exactly one float32 value, got " + describe_dtype(a.dtype()) + " of shape " + describe_shape(a));
    bool cuda_mem = a.device_type() == kDevCUDA || a.device_type() == kDevCUDAManaged;
    if (on_cuda() != cuda_mem)
      throw Error(std::string(what) + " is on " + device_text(a.device_type(), a.device_id()) + " but the backend is " +
                  backend_name(opt_->backend()));
    return static_cast<const float*>(a.data());
  }

  std::unique_ptr<Optimizer> opt_;
  std::vector<nb::object> keep_;
  std::vector<int64_t> watch_indices_;
  std::vector<const void*> grads_;  // reused by take_grads
  std::vector<const void*> p_, g_, s_;  // reused by patch_pointers
  nb::object name_data_ptr_;
  int device_id_ = -1;
  float scale_value_ = 1, inf_value_ = 0;
  int64_t steps_taken_ = 0;  // _step_raw calls that returned (the torch front end's host step count)
};

// p.grad = None for every parameter, through the type's setter (found once per type): ZeRO stage 2
// frees the full gradients of thousands of parameters after each step, and a Python loop of
// attribute stores is a fair share of a small step's host time.
void clear_grads(const std::vector<nb::object>& params) {
  nb::object name = nb::steal(PyUnicode_InternFromString("grad"));
  PyTypeObject* cached = nullptr;
  PyGetSetDef* setter = nullptr;
  for (const nb::object& p : params) {
    PyTypeObject* t = Py_TYPE(p.ptr());
    if (t != cached) {
      PyObject* d = _PyType_Lookup(t, name.ptr());  // borrowed
      setter = d && Py_TYPE(d) == &PyGetSetDescr_Type ? reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset : nullptr;
      cached = t;
    }
    int rc = setter && setter->set ? setter->set(p.ptr(), Py_None, setter->closure)
                                   : PyObject_SetAttr(p.ptr(), name.ptr(), Py_None);
    if (rc != 0) throw nb::python_error();
  }
}

}  // namespace

void bind_optimizer(nb::module_& m) {
  // --- Optimizer
  nb::class_<PyOptimizer>(m, "Optimizer", "A compiled chain with its scalars, stepping caller-owned tensors.")
      .def(nb::init<nb::handle, const std::string&, int, const std::string&, nb::handle>(), "chain"_a,
           "backend"_a = "cpu", "groups"_a = 1, "master_weights"_a = "none", "kahan"_a = nb::none(),
           "master_weights: 'none', 'copy' (a float32 master state) or 'remainders' (an int16 remainder state, "
           "bfloat16 parameters); kahan: None or the parameters' dtype name for Kahan-compensated updates.")
      .def_prop_ro("backend", [](PyOptimizer& o) { return std::string(backend_name(o.get().backend())); })
      .def_prop_ro("num_groups", [](PyOptimizer& o) { return o.get().num_groups(); })
      .def_prop_ro("plan", [](PyOptimizer& o) { return o.get().plan(); })
      .def_prop_ro("state_names", [](PyOptimizer& o) {
        std::vector<std::string> out;
        for (auto& s : o.get().plan().program.states) out.push_back(s.name);
        return out;
      }, "Short state names in table order ('exp_avg', ...).")
      .def_prop_ro("state_specs", [](PyOptimizer& o) {
        std::vector<std::tuple<std::string, std::string, double>> out;
        for (auto& s : o.get().plan().program.states) out.emplace_back(s.name, s.qualified, s.init);
        return out;
      }, "(name, qualified name, initial value) per state slot.")
      .def_prop_ro("state_storage", [](PyOptimizer& o) {
        std::vector<std::tuple<bool, std::optional<std::string>>> out;
        for (auto& s : o.get().plan().program.states)
          out.emplace_back(s.init_from_param, s.fixed_dtype ? std::optional<std::string>(dtype_name(s.dtype)) : std::nullopt);
        return out;
      }, "(starts as a copy of the parameter, fixed dtype name or None) per state slot.")
      .def_prop_ro("state_shapes", [](PyOptimizer& o) {
        std::vector<std::string> out;
        for (auto& s : o.get().plan().program.states) out.push_back(state_shape_name(s.shape));
        return out;
      }, "Per state slot: 'full' (one value per element), 'rows' or 'columns' (one per row / column of the "
         "parameter's matrix view, TensorRef.cols).")
      .def_prop_ro("uniform_state_specs", [](PyOptimizer& o) {
        std::vector<std::tuple<std::string, std::string, double>> out;
        for (auto& u : o.get().plan().program.uniform_states) out.emplace_back(u.name, u.qualified, u.init);
        return out;
      }, "(name, qualified name, initial value) per uniform state (one float64 per group, kept across steps).")
      .def_prop_ro("hyper_names", [](PyOptimizer& o) {
        std::vector<std::string> out;
        for (auto& h : o.get().plan().program.hypers) out.push_back(h.qualified);
        return out;
      })
      .def_prop_ro("hyper_short_names", [](PyOptimizer& o) {
        std::vector<std::string> out;
        for (auto& h : o.get().plan().program.hypers) out.push_back(h.name);
        return out;
      })
      .def_prop_ro("num_tensors", [](PyOptimizer& o) { return o.get().tensors().size(); })
      .def_prop_ro("device_id", &PyOptimizer::device_id)
      .def("add_group", [](PyOptimizer& o) { return o.get().add_group(); })
      .def("set_hyper", [](PyOptimizer& o, int g, const std::string& n, double v) { o.get().set_hyper(g, n, v); },
           "group"_a, "name"_a, "value"_a)
      .def("_set_hyper_unchecked", [](PyOptimizer& o, int g, const std::string& n, double v) {
        o.get().set_hyper_unchecked(g, n, v);
      }, "group"_a, "name"_a, "value"_a, "set_hyper without the range check (torch's param_groups accept any value).")
      .def("hyper", [](PyOptimizer& o, int g, const std::string& n) { return o.get().hyper(g, n); }, "group"_a, "name"_a)
      .def("step_count", [](PyOptimizer& o, int g) { return o.get().step_count(g); }, "group"_a = 0)
      .def("set_step_count", [](PyOptimizer& o, int g, int64_t s) { o.get().set_step_count(g, s); }, "group"_a, "steps"_a)
      .def("uniform_state", [](PyOptimizer& o, int g, const std::string& n) { return o.get().uniform_state(g, n); },
           "group"_a, "name"_a, "A group's uniform state (short or qualified name), as the last step not skipped left it.")
      .def("set_uniform_state", [](PyOptimizer& o, int g, const std::string& n, double v) {
        o.get().set_uniform_state(g, n, v);
      }, "group"_a, "name"_a, "value"_a)
      .def("set_tensors", &PyOptimizer::set_tensors, "tensors"_a, "stochastic_rounding"_a = false, "rng_seed"_a = 0,
           "tensors: list of (param, grad, [states], group); arrays with DLPack, contiguous, float32/float16/bfloat16 "
           "(each role its own; int16 for a master-weight remainder state). stochastic_rounding: float16/bfloat16 "
           "parameters and states are stored with stochastic rounding, tensor t's stream keyed on (rng_seed << 32) ^ t.")
      .def("step", &PyOptimizer::step, "grad_scale"_a = nb::none(), "found_inf"_a = nb::none(), "stream"_a = nb::none())
      .def("source", [](PyOptimizer& o) { return o.get().source(); })
      .def("backend_status", [](PyOptimizer& o) { return o.get().backend_status(); })
      .def("_set_tensors_raw", &PyOptimizer::set_tensors_raw, "params"_a, "grads"_a, "states"_a, "numels"_a, "dtypes"_a,
           "groups"_a, "device_id"_a, "watch_indices"_a, "stochastic"_a, "rng_keys"_a, "rng_offsets"_a,
           "cols"_a = std::vector<int64_t>(), "matrix_rows"_a = std::vector<int64_t>())
      .def("_patch_pointers", &PyOptimizer::patch_pointers, "params"_a.none(), "grads"_a.none(), "states"_a.none())
      .def("_take_grads", [](PyOptimizer& o, nb::handle w) { return o.take_grads(watch_pointers(w)); })
      .def("_bind_hyper_raw", &PyOptimizer::bind_hyper_raw, "group"_a, "name"_a, "ptr"_a, "is_f64"_a)
      .def("_step_raw", &PyOptimizer::step_raw, "grad_scale"_a, "found_inf"_a, "stream"_a)
      .def_prop_ro("_steps_taken", &PyOptimizer::steps_taken, "_step_raw calls that returned.")
      .def_prop_ro("chunk_elements", [](PyOptimizer& o) { return o.get().chunk_elements(); },
                   "Elements per chunk: the unit of partial sums, so of shard cuts.")
      .def("_set_exchange", &PyOptimizer::set_exchange, "global_chunks"_a, "firsts"_a, "counts"_a, "fn"_a.none());

  m.def("_clear_grads", &clear_grads, "params"_a, "p.grad = None for every parameter of the list.");
}

}  // namespace optfuse::py
