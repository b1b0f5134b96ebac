// Arrays through DLPack (or the buffer protocol) as the core's Buffers: what the Optimizer and
// MatrixChainOptimizer bindings accept as parameters, gradients and states, with their checks.
#include "bindings/arrays.h"

#include "bindings/common.h"

#include <nanobind/stl/string.h>

#include "optfuse/error.h"

namespace optfuse::py {

std::string describe_dtype(nb::dlpack::dtype t) {
  const char* base = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: break;
  }
  return base + std::to_string(t.bits) + (t.lanes != 1 ? "x" + std::to_string(t.lanes) : "");
}

std::optional<DType> to_dtype(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (code == nb::dlpack::dtype_code::Float && t.bits == 32) return DType::f32;
  if (code == nb::dlpack::dtype_code::Float && t.bits == 16) return DType::f16;
  if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return DType::bf16;
  if (code == nb::dlpack::dtype_code::Int && t.bits == 16) return DType::i16;
  return std::nullopt;
}

std::string describe_shape(const nb::ndarray<nb::ro>& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool c_contiguous(const nb::ndarray<nb::ro>& a) {
  if (a.size() == 0 || a.stride_ptr() == nullptr) return true;
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

std::string device_text(int type, int id) {
  if (type == kDevCPU) return "cpu";
  if (type == kDevCUDA || type == kDevCUDAManaged) return "cuda:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
}

namespace {

// Why an array the optimizer would write (a parameter or a state) must not be written, or "" if
// nothing says so before a DLPack export: a JAX array (immutable by contract, but its DLPack
// export is not flagged read-only, so only its type tells), or an array whose flags.writeable is
// False (NumPy and look-alikes; checked directly rather than relying on how a NumPy version flags
// its export).
std::string read_only_reason(nb::handle h) {
  nb::object module = nb::getattr(h.type(), "__module__", nb::none());
  if (nb::isinstance<nb::str>(module)) {
    std::string m = nb::cast<std::string>(module);
    for (const char* jax : {"jax", "jaxlib"}) {
      std::string p = jax;
      if (m == p || m.rfind(p + ".", 0) == 0)
        return "is a JAX array (" + type_name_of(h) + "); JAX arrays are immutable (read-only), and writing one in "
               "place would break every computation that shares it";
    }
  }
  nb::object flags = nb::getattr(h, "flags", nb::none());
  if (!flags.is_none()) {
    nb::object writeable = nb::getattr(flags, "writeable", nb::none());
    if (writeable.ptr() == Py_False) return "is read-only (its flags.writeable is False)";
  }
  return "";
}

}  // namespace

nb::ndarray<nb::ro> read_array(nb::handle h, const std::string& what, bool writable, std::vector<nb::object>& keep) {
  const char* why_writable = "; the optimizer writes parameters and states in place, so pass a writable array "
                             "(NumPy, torch, CuPy; a read-only array only as a gradient)";
  if (writable) {
    std::string reason = read_only_reason(h);
    if (!reason.empty()) throw Error(what + " " + reason + why_writable);
  }
  nb::ndarray<nb::ro> ro;
  if (!nb::try_cast(h, ro, false))
    throw Error(what + ": expected an array with DLPack or the buffer protocol (NumPy array, torch tensor), got " + type_name_of(h));
  if (writable) {
    // nanobind asks for a writable view: it requests a versioned DLPack capsule (DLPack >= 1.0)
    // and refuses one flagged DLPACK_FLAG_BITMASK_READ_ONLY, or a read-only buffer.
    nb::ndarray<> rw;
    if (!nb::try_cast(h, rw, false))
      throw Error(what + " is read-only (its DLPack export is flagged read-only, or its buffer is not writable)" +
                  why_writable);
  }
  keep.push_back(nb::borrow(h));
  return ro;
}

Buffer array_buffer(const nb::ndarray<nb::ro>& a, const std::string& what, const nb::ndarray<nb::ro>& param, Backend backend,
                    int& dev_id) {
  const bool on_cuda = backend == Backend::cuda;
  std::optional<DType> d = to_dtype(a.dtype());
  if (!d) throw Error(what + " has dtype " + describe_dtype(a.dtype()) + "; optfuse supports float32, float16 and bfloat16");
  if (!c_contiguous(a))
    throw Error(what + " is not contiguous (the fused kernel walks memory linearly); pass a contiguous array "
                "(torch: .contiguous(), NumPy: np.ascontiguousarray)");
  bool cuda_mem = a.device_type() == kDevCUDA || a.device_type() == kDevCUDAManaged;
  if (on_cuda && !cuda_mem)
    throw Error(what + " is on " + device_text(a.device_type(), a.device_id()) + " but the backend is cuda");
  if (!on_cuda && a.device_type() != kDevCPU)
    throw Error(what + " is on " + device_text(a.device_type(), a.device_id()) + " but the backend is " +
                backend_name(backend) + " (host memory only)");
  int id = a.device_type() == kDevCPU ? -1 : a.device_id();
  if (dev_id == -1 && id != -1) dev_id = id;
  if (id != dev_id)
    throw Error(what + " is on " + device_text(a.device_type(), a.device_id()) + " but other tensors are on cuda:" +
                std::to_string(dev_id) + "; one optimizer steps tensors of one device");
  if (a.size() != param.size())
    throw Error(what + " has shape " + describe_shape(a) + " (" + std::to_string(a.size()) +
                " elements) but the parameter has shape " + describe_shape(param) + " (" + std::to_string(param.size()) + ")");
  return Buffer{const_cast<void*>(static_cast<const void*>(a.data())), static_cast<int64_t>(a.size()), *d};
}

TensorRef read_tensor_item(nb::handle item, const std::string& where, const std::vector<ProgramState>& states,
                           Backend backend, int& dev_id, std::vector<nb::object>& keep, nb::ndarray<nb::ro>* param_array) {
  if (!nb::isinstance<nb::tuple>(item) && !nb::isinstance<nb::list>(item))
    throw Error(where + ": expected a tuple (param, grad, [states], group), got " + type_name_of(item));
  const size_t n = nb::len(item);
  if (n != 3 && n != 4) throw Error(where + ": expected (param, grad, [states]) or (param, grad, [states], group)");
  TensorRef r;
  nb::ndarray<nb::ro> param = read_array(item[0], where + ": param", true, keep);
  r.param = array_buffer(param, where + ": param", param, backend, dev_id);
  r.grad = array_buffer(read_array(item[1], where + ": grad", false, keep), where + ": grad", param, backend, dev_id);
  nb::handle st = item[2];
  const bool is_list = nb::isinstance<nb::tuple>(st) || nb::isinstance<nb::list>(st);
  if (!is_list || nb::len(st) != states.size()) {
    std::string names;
    for (const ProgramState& s : states) names += (names.empty() ? "" : ", ") + s.qualified;
    throw Error(where + ": states must be a list of " + std::to_string(states.size()) + " state arrays (" + names +
                "), got " + (is_list ? std::to_string(nb::len(st)) : type_name_of(st)));
  }
  size_t k = 0;
  for (nb::handle a : st) {
    const std::string w = where + ": state " + states[k++].qualified;
    r.states.push_back(array_buffer(read_array(a, w, true, keep), w, param, backend, dev_id));
  }
  r.group = n == 4 ? nb::cast<int>(item[3]) : 0;
  if (param_array) *param_array = param;
  return r;
}

}  // namespace optfuse::py
