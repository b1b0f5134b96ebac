// optfuse._torch_reader: reads a torch.Tensor's layout (data pointer, dtype, device, shape, strides)
// straight from its TensorImpl, in a few nanoseconds, for the torch front end's per-step check
// (table_watch.cpp) of every parameter, gradient and state tensor a step touches.
//
// Why a module of its own: torch's DLPack C exchange API (dlpack_exchange.h), the public way to do
// this without linking torch, costs 90-110 ns a tensor (a pybind11 caster and a GIL guard per
// call); a step of GPT-2's 148 parameters reads about 600 tensors. This module is compiled against
// the installed torch's headers (python/CMakeLists.txt builds it only where torch is importable at
// build time) and is used only by the torch it was built for: optfuse.torch installs it after
// checking torch.__version__ and comparing its reads with the exchange API's on probe tensors.
// It reads no tensor it does not fully understand: anything but a plain dense strided CPU or CUDA
// tensor of a plain torch.Tensor/Parameter type (subclasses such as DTensor, conjugate or negative
// views, functional or batched wrappers, copy-on-write storage, symbolic shapes, other devices and
// dtypes) answers "not mine", and the caller asks the exchange API. It links libc10 only, which
// torch has loaded by the time optfuse.torch imports this module.
//
// The interface is C: a PyCapsule "optfuse.torch_reader" holding a `dlpack_exchange::Reader` (a
// tensor's layout, a parameter's gradient's layout with a reference that keeps it alive, and the
// release of that reference; never a Python error), so that optfuse._core, built without torch,
// calls it directly. Layouts are DLPack's DLTensor (dlpack_exchange.h).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>

#include <cstdint>

#include "bindings/dlpack_exchange.h"

namespace {

namespace dx = optfuse::py::dlpack_exchange;

PyTypeObject* g_types[2] = {nullptr, nullptr};  // torch.Tensor, torch.nn.Parameter (install())

// DLPack's codes (dlpack.h: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6)
// for the dtypes optfuse steps or checks; 0 bits: not mine.
dx::DataType dlpack_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return {2, 32, 1};
    case c10::ScalarType::Double: return {2, 64, 1};
    case c10::ScalarType::Half: return {2, 16, 1};
    case c10::ScalarType::BFloat16: return {4, 16, 1};
    case c10::ScalarType::ComplexFloat: return {5, 64, 1};
    case c10::ScalarType::ComplexDouble: return {5, 128, 1};
    case c10::ScalarType::Short: return {0, 16, 1};  // (master-weight remainder states)
    case c10::ScalarType::Int: return {0, 32, 1};
    case c10::ScalarType::Long: return {0, 64, 1};
    case c10::ScalarType::Char: return {0, 8, 1};
    case c10::ScalarType::Byte: return {1, 8, 1};
    case c10::ScalarType::Bool: return {6, 8, 1};
    default: return {0, 0, 0};
  }
}

// The dispatch keys of a plain dense CPU or CUDA tensor (with autograd and autocast); a tensor
// with any other key (Conjugate, Negative, Functionalize, Python, FuncTorchBatched, Sparse, ...)
// is not mine.
const c10::DispatchKeySet& plain_keys() {
  static const c10::DispatchKeySet keys = c10::DispatchKeySet({
      c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::ADInplaceOrView,
      c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA, c10::DispatchKey::AutocastCPU,
      c10::DispatchKey::AutocastCUDA});
  return keys;
}

// The layout of a TensorImpl, where it is a plain dense strided CPU or CUDA tensor (0), else 1.
int read_impl(const c10::TensorImpl* impl, dx::Tensor* out) {
  if (!impl) return 1;
  // (raw bits: DispatchKeySet's operator- keeps the backend bits)
  if (impl->key_set().raw_repr() & ~plain_keys().raw_repr()) return 1;
  if (impl->has_symbolic_sizes_strides() || !impl->dtype_initialized()) return 1;
  // storage(), not the out-of-line has_storage(): the plain tensors admitted above keep theirs in
  // storage_ (storage() throws where access is refused: caught by the callers)
  const c10::Storage& storage = impl->storage();
  if (!storage) return 1;
  const c10::Device device = impl->device();
  int32_t device_type;
  if (device.is_cpu())
    device_type = 1;  // kDLCPU
  else if (device.is_cuda())
    device_type = 2;  // kDLCUDA
  else
    return 1;
  const dx::DataType dtype = dlpack_dtype(impl->dtype().toScalarType());
  if (dtype.bits == 0) return 1;
  if (c10::impl::cow::is_cow_data_ptr(storage.data_ptr())) return 1;  // (a write must materialize it)
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  // TensorImpl::data()'s answer (null for an empty tensor, as data_ptr()) without its out-of-line
  // has_storage() call
  out->data = impl->numel() == 0 ? nullptr
                                 : const_cast<char*>(static_cast<const char*>(storage.data())) +
                                       impl->itemsize() * static_cast<size_t>(impl->storage_offset());
  out->byte_offset = 0;
  out->device = {device_type, device_type == 1 ? 0 : static_cast<int32_t>(device.index())};
  out->ndim = static_cast<int32_t>(sizes.size());
  out->dtype = dtype;
  out->shape = const_cast<int64_t*>(sizes.data());
  out->strides = const_cast<int64_t*>(strides.data());
  return 0;
}

const c10::TensorImpl* impl_of(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  if (type != g_types[0] && type != g_types[1]) return nullptr;
  return THPVariable_Unpack(obj).unsafeGetTensorImpl();
}

int read(PyObject* obj, dx::Tensor* out) noexcept {
  try {
    return read_impl(impl_of(obj), out);
  } catch (...) {  // (none expected for the tensors admitted; never a crash or a Python error)
    return 1;
  }
}

// param.grad's layout read from the parameter's TensorImpl, without torch's `.grad` getter (which
// makes a Python wrapper for every gradient backward created: an allocation per parameter and
// step). 0: read, and *hold is a reference to the gradient's TensorImpl, to be given to drop()
// once the launch that reads it is done (another thread may replace `.grad` meanwhile); 2: the
// parameter has no gradient; 1: not mine (the caller asks `.grad`).
int read_grad(PyObject* param, dx::Tensor* out, void** hold) noexcept {
  try {
    const c10::TensorImpl* impl = impl_of(param);
    if (!impl) return 1;
    const at::Tensor& grad = impl->grad();
    if (!grad.defined()) return 2;
    c10::TensorImpl* g = grad.unsafeGetTensorImpl();
    if (read_impl(g, out) != 0) return 1;
    c10::raw::intrusive_ptr::incref(g);
    *hold = g;
    return 0;
  } catch (...) {
    return 1;
  }
}

void drop(void* hold) noexcept { c10::raw::intrusive_ptr::decref(static_cast<c10::TensorImpl*>(hold)); }

const dx::Reader g_reader = {1, &read, &read_grad, &drop};

PyObject* install(PyObject*, PyObject* args) {
  PyObject *tensor_type, *parameter_type;
  if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &tensor_type, &PyType_Type, &parameter_type)) return nullptr;
  g_types[0] = reinterpret_cast<PyTypeObject*>(tensor_type);
  g_types[1] = reinterpret_cast<PyTypeObject*>(parameter_type);
  Py_INCREF(tensor_type);  // (kept for the process: the types outlive every tensor read)
  Py_INCREF(parameter_type);
  return PyCapsule_New(const_cast<dx::Reader*>(&g_reader), "optfuse.torch_reader", nullptr);
}

PyMethodDef methods[] = {
    {"install", install, METH_VARARGS,
     "install(torch.Tensor, torch.nn.Parameter) -> capsule: the reader for tensors of exactly these types"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_torch_reader",
                      "Reads torch tensors' layouts from their TensorImpl (built for one torch version)", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__torch_reader() {
  PyObject* m = PyModule_Create(&module);
  if (!m) return nullptr;
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", OPTFUSE_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
