// Arrays through DLPack (or the buffer protocol) as the core's Buffers (arrays.cpp), for the
// bindings that take caller-owned arrays (optimizer.cpp: Optimizer, MatrixChainOptimizer).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>
#include <vector>

#include "optfuse/optimizer.h"

namespace nb = nanobind;

namespace optfuse::py {

constexpr int kDevCPU = 1, kDevCUDA = 2, kDevCUDAManaged = 13;  // DLPack device types

std::string describe_dtype(nb::dlpack::dtype t);
std::optional<DType> to_dtype(nb::dlpack::dtype t);
std::string describe_shape(const nb::ndarray<nb::ro>& a);
bool c_contiguous(const nb::ndarray<nb::ro>& a);
std::string device_text(int type, int id);

// An array through DLPack (or the buffer protocol). writable: a parameter or a state, which the
// optimizer updates in place, so read-only and immutable (JAX) arrays are refused; gradients are
// only read and may be read-only. The array is kept alive in `keep`.
nb::ndarray<nb::ro> read_array(nb::handle h, const std::string& what, bool writable, std::vector<nb::object>& keep);
// The array as a Buffer for `backend`: a supported dtype, contiguous, on the backend's device (the
// same device as the other arrays: dev_id, -1 until one is seen), as many elements as `param`.
Buffer array_buffer(const nb::ndarray<nb::ro>& a, const std::string& what, const nb::ndarray<nb::ro>& param, Backend backend,
                    int& dev_id);

// One item of a set_tensors list, (param, grad, [states]) or (param, grad, [states], group), as a
// TensorRef (group 0 when left out) for `backend`; states in `states`' order. The arrays are kept
// in `keep`; *param_array (if given) receives the parameter's array (its shape).
TensorRef read_tensor_item(nb::handle item, const std::string& where, const std::vector<ProgramState>& states,
                           Backend backend, int& dev_id, std::vector<nb::object>& keep,
                           nb::ndarray<nb::ro>* param_array = nullptr);

}  // namespace optfuse::py
