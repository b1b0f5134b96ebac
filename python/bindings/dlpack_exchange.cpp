// The DLPack C exchange API table of torch.Tensor (dlpack_exchange.h) and the function the torch
// front end calls to install it.
#include "bindings/dlpack_exchange.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/common.h"
#include "optfuse/error.h"

using namespace nb::literals;

namespace optfuse::py::dlpack_exchange {

namespace {
const Api* g_exchange = nullptr;  // torch.Tensor's own table (_set_torch_exchange)
const Reader* g_reader = nullptr; // optfuse._torch_reader's reader (_set_torch_reader)
Api g_with_reader{};              // g_exchange, its tensor read going through g_reader first
const Api* g_torch_api = nullptr; // what callers use: g_exchange, &g_with_reader or null

int read_through_reader(void* obj, Tensor* out) {
  // (g_reader may have been taken away since a TableWatch kept this table)
  const Reader* r = g_reader;
  if (r && r->read(static_cast<PyObject*>(obj), out) == 0) return 0;
  if (g_exchange) return g_exchange->dltensor_from_py_object_no_sync(obj, out);
  PyErr_SetString(PyExc_TypeError, "optfuse: the torch reader cannot describe this tensor");
  return -1;
}

void choose_api() {
  if (!g_reader) {
    g_torch_api = g_exchange;
    return;
  }
  g_with_reader = g_exchange ? *g_exchange : Api{{{1, 0}, nullptr}, nullptr, nullptr, nullptr, nullptr, nullptr};
  g_with_reader.dltensor_from_py_object_no_sync = &read_through_reader;
  g_torch_api = &g_with_reader;
}
}  // namespace

const Api* find(PyObject* tensor_type) {
  // DLPack 1.3's name (a capsule); torch 2.10 published the table under the draft's name.
  for (const char* name : {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"}) {
    PyObject* attr = PyObject_GetAttrString(tensor_type, name);
    if (!attr) {
      PyErr_Clear();
      continue;
    }
    const Api* api = nullptr;
    if (PyCapsule_IsValid(attr, "dlpack_exchange_api"))
      api = static_cast<const Api*>(PyCapsule_GetPointer(attr, "dlpack_exchange_api"));
    else if (PyLong_Check(attr))  // the draft published the table's address as an int
      api = static_cast<const Api*>(PyLong_AsVoidPtr(attr));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      api = nullptr;
    }
    Py_DECREF(attr);
    if (api && api->header.version.major == 1 && api->dltensor_from_py_object_no_sync)
      return api;
  }
  return nullptr;
}

const Api* torch_api() { return g_torch_api; }
const Api* torch_exchange() { return g_exchange; }
const Reader* torch_reader() { return g_reader; }
void set_torch_api(const Api* api) {
  g_exchange = api;
  choose_api();
}
void set_torch_reader(const Reader* reader) {
  g_reader = reader;
  choose_api();
}

}  // namespace optfuse::py::dlpack_exchange

namespace optfuse::py {

void bind_dlpack_exchange(nb::module_& m) {
  namespace dx = dlpack_exchange;
  m.def("_set_torch_exchange", [](nb::handle tensor_type) {
    dx::set_torch_api(tensor_type.is_none() ? nullptr : dx::find(tensor_type.ptr()));
    return dx::torch_exchange() != nullptr;
  }, "tensor_type"_a.none(),
        "Reads gradients through the DLPack C exchange API of tensor_type (torch.Tensor); None: through "
        "Python method calls. Returns whether the API is in use.");
  m.def("_set_torch_reader", [](nb::handle capsule) {
    const dx::Reader* reader = nullptr;
    if (!capsule.is_none()) {
      reader = static_cast<const dx::Reader*>(PyCapsule_GetPointer(capsule.ptr(), "optfuse.torch_reader"));
      if (!reader) throw nb::python_error();
      if (reader->version != 1) throw Error("optfuse._torch_reader: another version of its interface (rebuild optfuse)");
    }
    dx::set_torch_reader(reader);
  }, "capsule"_a.none(),
        "Reads tensors first through optfuse._torch_reader's reader (its install() capsule), then, for "
        "tensors it leaves, through the exchange API; None: the exchange API alone.");
  // One tensor's layout (pointer, DLPack dtype code, bits, lanes, device type and id, shape,
  // strides) as read by `source`: "current" (what the per-step check uses), "exchange" (torch's
  // table alone) or "reader" (optfuse._torch_reader's alone); None where it cannot. For the
  // install-time comparison of the two and the tests.
  m.def("_read_layout", [](nb::handle tensor, const std::string& source) -> nb::object {
    dx::Tensor x;
    if (source == "reader") {
      if (!dx::torch_reader() || dx::torch_reader()->read(tensor.ptr(), &x) != 0) return nb::none();
    } else {
      if (source != "current" && source != "exchange") throw Error("_read_layout: source is current, exchange or reader");
      const dx::Api* api = source == "exchange" ? dx::torch_exchange() : dx::torch_api();
      if (!api || api->dltensor_from_py_object_no_sync(tensor.ptr(), &x) != 0) {
        PyErr_Clear();
        return nb::none();
      }
    }
    nb::list shape, strides;
    int64_t compact = 1;
    for (int32_t k = x.ndim - 1; k >= 0; --k) {
      shape.insert(0, x.shape[k]);
      strides.insert(0, x.strides ? x.strides[k] : compact);
      compact *= x.shape[k];
    }
    return nb::make_tuple(reinterpret_cast<uint64_t>(x.data) + x.byte_offset, x.dtype.code, x.dtype.bits,
                          x.dtype.lanes, x.device.device_type, x.device.device_id, nb::tuple(shape),
                          nb::tuple(strides));
  }, "tensor"_a, "source"_a = "current");
}

}  // namespace optfuse::py
