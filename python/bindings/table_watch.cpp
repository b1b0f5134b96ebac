// TableWatch: the torch front end's per-step check that the engine's tables still describe torch's
// live tensors (python/optfuse/torch/_binding.py decides what to do with the answer).
//
// torch owns the truth: every parameter, gradient and state tensor a step reads or writes may have
// been replaced since the tables were built (`p.data = ...`, `p.grad.set_(...)`, a new `.grad` after
// zero_grad, `opt.state[p]["exp_avg"] = ...`, `opt.state[p] = {...}`). Each step, check() reads
// every one of them from torch's objects and compares what the kernel depends on (data pointer,
// dtype, device, shape, strides) with what the tables were built from:
//   0  nothing changed
//   1  only gradient pointers moved (new gradient tensors of the same layout, as after zero_grad +
//      backward): pointers() holds them; the caller re-points the tables
//   2  anything else: a parameter or state changed in any way, a gradient appeared, vanished or
//      changed its dtype, shape or strides, a DTensor's local tensor changed: the caller rebuilds
//      the tables from torch's objects (and refuses there what the kernels cannot step).
// Reading a tensor: through dlpack_exchange::torch_api(), i.e. optfuse._torch_reader where it is in
// use (torch_reader.cpp: the TensorImpl's fields, a few nanoseconds; a parameter's gradient read
// from the parameter's TensorImpl, no `.grad` wrapper made), else torch.Tensor's DLPack C exchange
// API (torch >= 2.10, about 100 ns a call), or, without it (or for a tensor neither can describe),
// its data_ptr() and a Python tuple (shape, stride(), dtype, device).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bindings/common.h"
#include "bindings/dlpack_exchange.h"
#include "optfuse/error.h"

using namespace nb::literals;

namespace optfuse::py {

namespace {

namespace dx = dlpack_exchange;

// What the kernel depends on in one tensor. Through the exchange API: the fields; otherwise `slow`
// holds the Python tuple
// (shape, stride(), dtype, device) beside ptr.
struct TensorLayout {
  uint64_t ptr = 0;
  uint32_t dtype = 0;
  int32_t device_type = 0, device_id = 0;
  int32_t ndim = -1;  // -1: not read (absent tensor)
  std::vector<int64_t> dims;  // shape, then strides (in elements)
  nb::object slow;  // the Python description, where the exchange API could not read the tensor
  bool unreadable = false;  // neither could describe it (a sparse tensor has no data_ptr())

  bool same_but_pointer(const TensorLayout& o) const {
    if (slow.is_valid() || o.slow.is_valid()) {
      if (!slow.is_valid() || !o.slow.is_valid()) return false;
      int eq = PyObject_RichCompareBool(slow.ptr(), o.slow.ptr(), Py_EQ);
      if (eq < 0) throw nb::python_error();
      return eq == 1;
    }
    return dtype == o.dtype && device_type == o.device_type && device_id == o.device_id && ndim == o.ndim &&
           dims == o.dims;
  }
  bool same(const TensorLayout& o) const { return ptr == o.ptr && same_but_pointer(o); }
};

class TableWatch {
 public:
  // params: the parameters whose .grad is watched (the torch group order). offsets: bytes added to
  // each gradient's data pointer (ZeRO's pieces: a piece's gradient is its parameter's, `begin`
  // elements in); none: 0. local_shard: per parameter, whether it is a DTensor whose local tensor
  // (`_local_tensor`, FSDP2's shard) is what the kernel steps; none: no.
  TableWatch(std::vector<nb::object> params, std::vector<int64_t> offsets, std::vector<bool> local_shard)
      : params_(std::move(params)), offsets_(std::move(offsets)), local_(std::move(local_shard)),
        api_(dx::torch_api()) {
    if (offsets_.empty()) offsets_.assign(params_.size(), 0);
    if (local_.empty()) local_.assign(params_.size(), false);
    if (offsets_.size() != params_.size() || local_.size() != params_.size())
      throw Error("_TableWatch: one offset and one local_shard flag per parameter");
    name_local_ = intern("_local_tensor");
    name_grad_ = intern("grad");
    name_data_ptr_ = intern("data_ptr");
    name_shape_ = intern("shape");
    name_stride_ = intern("stride");
    name_dtype_ = intern("dtype");
    name_device_ = intern("device");
    grads_.resize(params_.size());
    held_.resize(params_.size());
    held_impls_.resize(params_.size());
    ptrs_.assign(params_.size(), 0);
    snapshot();
  }

  // The tensors the tables step besides gradients, watched from now on: for each entry k,
  // parameter params[slots[k]] itself and the state tensors state_dicts[k][key] for each key of
  // keys[k], where state_dicts[k] is the dict `state[params[slots[k]]]` (state: the optimizer's
  // opt.state mapping, handed to check() each time: it is replaced by load_state_dict).
  // Entries under the keys of `same_object_keys` (one list per slot, or none) are only checked to be
  // the same object: tensors the kernel neither reads nor writes (the step tensors the front end
  // advances), whose replacement the caller must notice but whose memory no launch touches.
  void watch_tables(nb::object state, std::vector<int64_t> slots, std::vector<nb::object> state_dicts,
                    std::vector<std::vector<nb::object>> keys, std::vector<std::vector<nb::object>> same_object_keys) {
    if (!same_object_keys.empty() && same_object_keys.size() != slots.size())
      throw Error("_TableWatch.watch_tables: one same-object key list per slot");
    if (state_dicts.size() != slots.size() || keys.size() != slots.size())
      throw Error("_TableWatch.watch_tables: one state dict and one key list per slot");
    state_ = std::move(state);
    entries_.clear();
    entries_.reserve(slots.size());
    for (size_t k = 0; k < slots.size(); ++k) {
      if (slots[k] < 0 || static_cast<size_t>(slots[k]) >= params_.size())
        throw Error("_TableWatch.watch_tables: slot out of range");
      Entry e;
      e.slot = static_cast<size_t>(slots[k]);
      nb::handle p = params_[e.slot];
      e.hash = PyObject_Hash(p.ptr());
      if (e.hash == -1) throw nb::python_error();
      e.dict = state_dicts[k];
      if (!e.dict.is_none() && !PyDict_Check(e.dict.ptr()))
        throw Error("_TableWatch.watch_tables: a state entry is not a dict");
      e.param = describe(tensor_of(p, local_[e.slot]).ptr());
      for (nb::object& key : keys[k]) {
        PyObject* s = e.dict.is_none() ? nullptr : PyDict_GetItemWithError(e.dict.ptr(), key.ptr());  // borrowed
        if (!s) {
          if (PyErr_Occurred()) throw nb::python_error();
          throw Error("_TableWatch.watch_tables: a watched state is missing");
        }
        nb::object state_obj = nb::borrow(s);
        e.states.push_back({key, state_obj, describe(tensor_of(state_obj, local_[e.slot]).ptr()), true});
      }
      if (!same_object_keys.empty()) {
        for (nb::object& key : same_object_keys[k]) {
          PyObject* s = e.dict.is_none() ? nullptr : PyDict_GetItemWithError(e.dict.ptr(), key.ptr());  // borrowed
          if (!s) {
            if (PyErr_Occurred()) throw nb::python_error();
            throw Error("_TableWatch.watch_tables: a watched state is missing");
          }
          e.states.push_back({key, nb::borrow(s), TensorLayout(), false});
        }
      }
      entries_.push_back(std::move(e));
    }
  }

  int check(nb::handle state) {
    // Parameters and states first: any change there rebuilds, whatever the gradients did.
    if (!entries_.empty() && state.ptr() != state_.ptr()) return 2;
    for (const Entry& e : entries_) {
      PyObject* p = params_[e.slot].ptr();
      if (!e.dict.is_none() && lookup(state_.ptr(), p, e.hash) != e.dict.ptr()) return 2;
      nb::object lp = tensor_of(p, local_[e.slot]);
      if (!same(lp.ptr(), e.param)) return 2;
      for (const WatchedState& s : e.states) {
        PyObject* now = PyDict_GetItemWithError(e.dict.ptr(), s.key.ptr());  // borrowed
        if (!now) {
          if (PyErr_Occurred()) throw nb::python_error();
          return 2;
        }
        if (now != s.object.ptr()) return 2;
        if (!s.read) continue;
        nb::object lt = tensor_of(nb::handle(now), local_[e.slot]);
        if (!same(lt.ptr(), s.layout)) return 2;
      }
    }
    int result = 0;
    const dx::Reader* reader = api_ ? dx::torch_reader() : nullptr;  // (none where Python describes tensors)
    for (size_t i = 0; i < params_.size(); ++i) {
      if (local_[i]) {  // FSDP2 re-pads a shard after e.g. model.load_state_dict(assign=True): rebuild
        PyObject* lp = get_local(params_[i].ptr());
        if (!lp) throw nb::python_error();
        Py_DECREF(lp);  // (the parameter keeps it alive: only its identity is compared)
        if (lp != param_locals_[i].ptr()) return 2;
      }
      const TensorLayout& recorded = grads_[i];
      if (reader && !local_[i] && !recorded.slow.is_valid() && !recorded.unreadable) {
        // the gradient read from the parameter's TensorImpl: no Python wrapper made or looked up
        dx::Tensor x;
        void* hold = nullptr;
        const int rc = reader->read_grad(params_[i].ptr(), &x, &hold);
        if (rc != 1) {
          held_[i] = nb::object();
          keep(i, reader, hold);  // (null where there is no gradient)
          if ((rc == 0) != (recorded.ndim >= 0)) return 2;  // a gradient appeared or vanished
          if (rc == 2) continue;
          uint64_t ptr = 0;
          const Match m = match_layout(x, recorded, &ptr);  // (before ptr is read: argument order is unspecified)
          if (!take_gradient(i, m, ptr, result)) return 2;
          continue;
        }
      }
      PyObject* g = get_grad(params_[i].ptr());
      if (!g) throw nb::python_error();
      if (local_[i] && g != Py_None) {  // the DTensor gradient's local shard
        PyObject* l = get_local(g);
        Py_DECREF(g);
        if (!l) throw nb::python_error();
        g = l;
      }
      nb::object grad = nb::steal(g);
      keep(i, nullptr, nullptr);
      held_[i] = grad;  // (kept alive until release(): another thread may replace it mid-launch)
      const TensorLayout& was = grads_[i];
      if ((g != Py_None) != (was.ndim >= 0)) return 2;  // a gradient appeared or vanished
      if (g == Py_None) continue;
      if (was.unreadable) {  // (a sparse gradient, stepped by torch's class: rebuild once it is readable)
        try {
          describe(g);
        } catch (nb::python_error&) {
          continue;
        }
        return 2;
      }
      uint64_t ptr = 0;
      const Match m = match(g, was, &ptr);
      if (!take_gradient(i, m, ptr, result)) return 2;
    }
    return result;
  }

  // Records every parameter's current .grad; returns them (None where absent).
  nb::list snapshot() {
    nb::list out;
    param_locals_.assign(params_.size(), nb::object());
    for (size_t i = 0; i < params_.size(); ++i) {
      if (local_[i]) param_locals_[i] = params_[i].attr(name_local_);
      nb::object grad = params_[i].attr(name_grad_);
      if (local_[i] && !grad.is_none()) grad = grad.attr(name_local_);
      grads_[i] = TensorLayout();
      ptrs_[i] = 0;
      if (!grad.is_none()) {
        try {
          grads_[i] = describe(grad.ptr());
          ptrs_[i] = nb::cast<uint64_t>(grad.attr(name_data_ptr_)()) + static_cast<uint64_t>(offsets_[i]);
        } catch (nb::python_error&) {  // e.g. a sparse gradient: the caller steps it or reports it
          grads_[i] = TensorLayout();
          grads_[i].ndim = 0;
          grads_[i].unreadable = true;
        }
      }
      held_[i] = grad;
      out.append(grad);
    }
    return out;
  }

  // Drops the references check() and snapshot() took to the gradients they read. Between them and
  // this call (the launch) the gradients the tables point at stay alive whatever another thread does
  // to `.grad`; after it, a gradient freed by zero_grad is not kept alive by the watch.
  void release() {
    for (nb::object& g : held_) g = nb::object();
    for (size_t i = 0; i < held_impls_.size(); ++i) keep(i, nullptr, nullptr);
  }

  ~TableWatch() {  // (the gradients' references taken through the reader; the GIL is held here)
    for (size_t i = 0; i < held_impls_.size(); ++i) keep(i, nullptr, nullptr);
  }
  TableWatch(const TableWatch&) = delete;
  TableWatch& operator=(const TableWatch&) = delete;

  const std::vector<uint64_t>& pointers() const { return ptrs_; }
  size_t size() const { return params_.size(); }

 private:
  struct WatchedState {
    nb::object key, object;
    TensorLayout layout;
    bool read;  // its layout is compared (a tensor the kernel steps), else only its identity
  };
  struct Entry {
    size_t slot = 0;
    Py_hash_t hash = 0;
    nb::object dict;  // state[param] when the tables were built (None: the parameter keeps no state)
    TensorLayout param;
    std::vector<WatchedState> states;
  };

  static nb::object intern(const char* s) { return nb::steal(PyUnicode_InternFromString(s)); }

  // state[p] (borrowed; null if absent) without calling p.__hash__ again: torch.Tensor's hash is a
  // Python method (id(self)), a fair share of a step's host time over thousands of parameters.
  static PyObject* lookup(PyObject* state, PyObject* p, Py_hash_t hash) {
    if (!PyDict_Check(state)) {
      PyObject* v = PyObject_GetItem(state, p);
      if (!v) {
        PyErr_Clear();
        return nullptr;
      }
      Py_DECREF(v);  // (the mapping keeps it alive: only its identity is compared)
      return v;
    }
#if PY_VERSION_HEX < 0x030D0000
    PyObject* v = _PyDict_GetItem_KnownHash(state, p, hash);
#else
    (void)hash;
    PyObject* v = PyDict_GetItemWithError(state, p);
#endif
    if (!v && PyErr_Occurred()) throw nb::python_error();
    return v;
  }

  // The tensor the kernel steps for x: x, or a DTensor's local shard.
  nb::object tensor_of(nb::handle x, bool local) {
    if (!local) return nb::borrow(x);
    PyObject* l = get_local(x.ptr());
    if (!l) {  // a plain tensor beside DTensor parameters (a state not yet a DTensor)
      PyErr_Clear();
      return nb::borrow(x);
    }
    return nb::steal(l);
  }

  bool same(PyObject* t, const TensorLayout& was) { return match(t, was, nullptr) == Match::same; }

  enum class Match { same, moved, different };  // (match(): a tensor against its recorded layout)

  // Parameter i's gradient as compared with the one the tables hold: false where they must be
  // rebuilt; a new gradient of the same layout (only its pointer moved) is taken, and result is 1.
  bool take_gradient(size_t i, Match m, uint64_t ptr, int& result) {
    if (m == Match::different) return false;
    if (m == Match::moved) {
      grads_[i].ptr = ptr;
      ptrs_[i] = ptr + static_cast<uint64_t>(offsets_[i]);
      result = 1;
    }
    return true;
  }

  // Parameter i's gradient as read through `reader` (hold: its reference, null for none), kept until
  // release() or the next read; the reference held before is dropped.
  void keep(size_t i, const dx::Reader* reader, void* hold) {
    HeldImpl& h = held_impls_[i];
    if (h.hold) h.reader->drop(h.hold);
    h = {reader, hold};
  }

  // How tensor t compares with `was`: the same layout and pointer, the same layout at another
  // pointer (*ptr_now), or different. Read once, without building a TensorLayout (no allocation on
  // the per-step path) unless it must be described through Python.
  Match match(PyObject* t, const TensorLayout& was, uint64_t* ptr_now) {
    dx::Tensor x;
    if (was.slow.is_valid() || !api_ || api_->dltensor_from_py_object_no_sync(t, &x) != 0) {
      if (api_ && !was.slow.is_valid()) PyErr_Clear();
      TensorLayout now = describe(t);
      if (!now.same_but_pointer(was)) return Match::different;
      if (ptr_now) *ptr_now = now.ptr;
      return now.ptr == was.ptr ? Match::same : Match::moved;
    }
    return match_layout(x, was, ptr_now);
  }

  static Match match_layout(const dx::Tensor& x, const TensorLayout& was, uint64_t* ptr_now) {
    const uint64_t ptr = reinterpret_cast<uint64_t>(x.data) + x.byte_offset;
    const uint32_t dtype = uint32_t{x.dtype.code} | uint32_t{x.dtype.bits} << 8 | uint32_t{x.dtype.lanes} << 16;
    if (dtype != was.dtype || x.device.device_type != was.device_type || x.device.device_id != was.device_id ||
        x.ndim != was.ndim)
      return Match::different;
    int64_t compact = 1;
    for (int32_t k = x.ndim - 1; k >= 0; --k) {
      const int64_t stride = x.strides ? x.strides[k] : compact;
      if (x.shape[k] != was.dims[static_cast<size_t>(k)] || stride != was.dims[static_cast<size_t>(x.ndim + k)])
        return Match::different;
      compact *= x.shape[k];
    }
    if (ptr_now) *ptr_now = ptr;
    return ptr == was.ptr ? Match::same : Match::moved;
  }

  TensorLayout describe(PyObject* t) {
    TensorLayout d;
    dx::Tensor x;
    if (api_ && api_->dltensor_from_py_object_no_sync(t, &x) == 0) {
      d.ptr = reinterpret_cast<uint64_t>(x.data) + x.byte_offset;
      d.dtype = uint32_t{x.dtype.code} | uint32_t{x.dtype.bits} << 8 | uint32_t{x.dtype.lanes} << 16;
      d.device_type = x.device.device_type;
      d.device_id = x.device.device_id;
      d.ndim = x.ndim;
      d.dims.resize(2 * static_cast<size_t>(x.ndim));
      int64_t compact = 1;
      for (int32_t k = x.ndim - 1; k >= 0; --k) {  // (null strides: a compact row-major tensor)
        d.dims[static_cast<size_t>(k)] = x.shape[k];
        d.dims[static_cast<size_t>(x.ndim + k)] = x.strides ? x.strides[k] : compact;
        compact *= x.shape[k];
      }
      return d;
    }
    if (api_) PyErr_Clear();
    nb::handle h(t);
    d.ndim = 0;
    d.ptr = nb::cast<uint64_t>(h.attr(name_data_ptr_)());
    d.slow = nb::make_tuple(h.attr(name_shape_), h.attr(name_stride_)(), h.attr(name_dtype_), h.attr(name_device_));
    return d;
  }

  // p.grad through the type's getset descriptor, found once per parameter type: skips the generic
  // attribute lookup, which is a fair share of the per-parameter cost here.
  PyObject* get_grad(PyObject* p) {
    PyTypeObject* t = Py_TYPE(p);
    if (t != cached_type_) {
      PyObject* d = _PyType_Lookup(t, name_grad_.ptr());  // borrowed
      getter_ = nullptr;
      if (d && Py_TYPE(d) == &PyGetSetDescr_Type) getter_ = reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset;
      cached_type_ = t;
    }
    if (getter_ && getter_->get) return getter_->get(p, getter_->closure);
    return PyObject_GetAttr(p, name_grad_.ptr());
  }

  // x._local_tensor of a DTensor through its type's descriptor (a slot), found once per type.
  PyObject* get_local(PyObject* x) {
    PyTypeObject* t = Py_TYPE(x);
    if (t != local_type_) {
      local_descr_ = _PyType_Lookup(t, name_local_.ptr());  // borrowed (the type keeps it)
      if (local_descr_ && !Py_TYPE(local_descr_)->tp_descr_get) local_descr_ = nullptr;
      local_type_ = t;
    }
    if (local_descr_) return Py_TYPE(local_descr_)->tp_descr_get(local_descr_, x, reinterpret_cast<PyObject*>(t));
    return PyObject_GetAttr(x, name_local_.ptr());
  }

  std::vector<nb::object> params_;
  std::vector<nb::object> param_locals_;  // per DTensor parameter: its local tensor at snapshot()
  std::vector<int64_t> offsets_;
  std::vector<bool> local_;
  std::vector<TensorLayout> grads_;  // per parameter: its gradient at snapshot() (ndim -1: none)
  std::vector<uint64_t> ptrs_;       // per parameter: its gradient's pointer (+ offset) for the tables
  std::vector<nb::object> held_;     // per parameter: the gradient last read, until release()
  struct HeldImpl {
    const dx::Reader* reader = nullptr;
    void* hold = nullptr;
  };
  std::vector<HeldImpl> held_impls_;  // per parameter: the same, where read through the reader
  std::vector<Entry> entries_;       // per table entry: the parameter and states it steps
  nb::object state_;                 // opt.state when the tables were built
  const dx::Api* api_;               // null: Python descriptions
  nb::object name_grad_, name_data_ptr_, name_shape_, name_stride_, name_local_, name_dtype_, name_device_;
  PyTypeObject* cached_type_ = nullptr;
  PyGetSetDef* getter_ = nullptr;
  PyTypeObject* local_type_ = nullptr;
  PyObject* local_descr_ = nullptr;
};

}  // namespace

const std::vector<uint64_t>& watch_pointers(nb::handle watch) { return nb::cast<TableWatch&>(watch).pointers(); }

void bind_table_watch(nb::module_& m) {
  nb::class_<TableWatch>(m, "_TableWatch")
      .def(nb::init<std::vector<nb::object>, std::vector<int64_t>, std::vector<bool>>(), "params"_a,
           "offsets"_a = std::vector<int64_t>(), "local_shard"_a = std::vector<bool>())
      .def("watch_tables", &TableWatch::watch_tables, "state"_a, "slots"_a, "state_dicts"_a, "keys"_a,
           "same_object_keys"_a = std::vector<std::vector<nb::object>>())
      .def("check", &TableWatch::check, "state"_a.none() = nb::none())
      .def("snapshot", &TableWatch::snapshot)
      .def("release", &TableWatch::release)
      .def("pointers", [](const TableWatch& w) { return w.pointers(); })
      .def("__len__", &TableWatch::size);
}

}  // namespace optfuse::py
