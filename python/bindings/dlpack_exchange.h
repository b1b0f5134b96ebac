// The DLPack C exchange API (DLPack 1.3: a type attribute `__dlpack_c_exchange_api__`, a PyCapsule
// named "dlpack_exchange_api" holding a table of C functions). torch >= 2.10 provides it on
// torch.Tensor. Through it the torch front end reads a gradient's data pointer, dtype and strides
// in a C call of some tens of nanoseconds instead of Python method calls
// (`data_ptr()`, `is_contiguous()`: about 120 ns each, the largest part of a step's host time over
// thousands of new gradients), without linking libtorch.
//
// The structs are declared here from the DLPack specification (they are its ABI: layouts fixed by
// the standard and checked by its major version). Nothing here owns a tensor: the DLTensor that
// dltensor_from_py_object_no_sync fills borrows the Python object's memory while the caller holds it.
#pragma once

#include <Python.h>

#include <cstdint>

namespace optfuse::py::dlpack_exchange {

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; may be null for a compact row-major tensor
  uint64_t byte_offset;
};
struct Version {
  uint32_t major, minor;
};
struct Header {
  Version version;
  Header* prev_api;
};
struct Api {
  Header header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, Tensor* out);  // 0, or -1 with a Python error
  void* current_work_stream;
};

// The layouts DLPack 1.x fixes on 64-bit hosts (DLTensor 48 bytes, DLPackExchangeAPI 56).
static_assert(sizeof(void*) == 8 && sizeof(Tensor) == 48 && sizeof(Api) == 56, "DLPack exchange ABI");

// The API of a tensor type (torch.Tensor), or null when the type has none, its DLPack major version
// is not 1, or it lacks the function used here. Looked up once by the caller.
const Api* find(PyObject* tensor_type);

// A reader of tensors' layouts that needs no Python call: optfuse._torch_reader's (torch_reader.cpp),
// handed over as a capsule. None of its functions sets a Python error.
using ReadFn = int (*)(PyObject* tensor, Tensor* out);  // 0: read; 1: not a tensor it reads
struct Reader {
  uint32_t version;  // 1
  ReadFn read;
  // param.grad's layout, without torch's .grad getter: 0 read (*hold: a reference keeping the
  // gradient alive, for drop()); 2 no gradient; 1 not one it reads (ask .grad)
  int (*read_grad)(PyObject* param, Tensor* out, void** hold);
  void (*drop)(void* hold);
};

// What callers read tensors through; null: none (then they take the Python method path). It is
// torch.Tensor's table set by `_set_torch_exchange(torch.Tensor)` (optfuse.torch does so on import),
// its tensor read going first through the reader set by `_set_torch_reader` where one is.
const Api* torch_api();
const Api* torch_exchange();  // torch's own table alone
const Reader* torch_reader();  // the reader alone (null: none)
void set_torch_api(const Api* api);
void set_torch_reader(const Reader* reader);

// Whether a DLTensor is laid out contiguously (row-major, as torch's is_contiguous(): strides of
// size-1 dimensions do not matter; an empty tensor is contiguous).
inline bool is_contiguous(const Tensor& t) {
  if (!t.strides) return true;
  for (int32_t d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return true;
  int64_t expected = 1;
  for (int32_t d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

}  // namespace optfuse::py::dlpack_exchange
