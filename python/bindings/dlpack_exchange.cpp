// The DLPack C exchange API table of torch.Tensor (dlpack_exchange.h) and the function the torch
// front end calls to install it.
#include "bindings/dlpack_exchange.h"

#include <nanobind/nanobind.h>

#include "bindings/common.h"

using namespace nb::literals;

namespace optfuse::py::dlpack_exchange {

namespace {
const Api* g_torch_api = nullptr;
}

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
void set_torch_api(const Api* api) { g_torch_api = api; }

}  // namespace optfuse::py::dlpack_exchange

namespace optfuse::py {

void bind_dlpack_exchange(nb::module_& m) {
  namespace dx = dlpack_exchange;
  m.def("_set_torch_exchange", [](nb::handle tensor_type) {
    dx::set_torch_api(tensor_type.is_none() ? nullptr : dx::find(tensor_type.ptr()));
    return dx::torch_api() != nullptr;
  }, "tensor_type"_a.none(),
        "Reads gradients through the DLPack C exchange API of tensor_type (torch.Tensor); None: through "
        "Python method calls. Returns whether the API is in use.");
}

}  // namespace optfuse::py
