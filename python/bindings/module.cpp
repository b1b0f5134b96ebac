// optfuse._core: the Python bindings of the C++ library (nanobind). No libtorch: arrays arrive
// through DLPack (nb::ndarray: NumPy, torch, CuPy, ... on CPU or CUDA), or, for the torch front end
// (optfuse/torch), as data pointers the Python side has already checked, so that rebuilding the
// tensor table for thousands of tensors does not pay a DLPack export per tensor.
//
// Files: module.cpp (this: the module, its errors), rules.cpp (Expr and RuleBuilder for rules
// written in Python; Range, Rule, chains, built-ins; plans and explain), optimizer.cpp (Optimizer),
// table_watch.cpp (TableWatch, the torch front end's per-step check of its tables against torch's
// tensors), dlpack_exchange.cpp (torch.Tensor's DLPack C exchange API, which TableWatch reads
// tensors through), matrix.cpp (NewtonSchulz, the matrix
// phase of Muon).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings/common.h"
#include "optfuse/dtype.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"

using namespace nb::literals;
using namespace optfuse;

namespace optfuse::py {

std::string type_name_of(nb::handle h) { return nb::type_name(h.type()).c_str(); }
bool is_number(nb::handle h) { return PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()); }

}  // namespace optfuse::py

namespace {

// ---------------------------------------------------------------------------------------------
// Errors: optfuse::BackendUnavailable -> optfuse.BackendUnavailable (RuntimeError),
// any other optfuse::Error -> optfuse.OptfuseError (a ValueError, and a RuntimeError too: torch
// raises RuntimeError for what a refused step or CUDA graph capture is, so callers catch either).

PyObject* g_error = nullptr;
PyObject* g_backend_unavailable = nullptr;

void translate_errors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const BackendUnavailable& e) {
    PyErr_SetString(g_backend_unavailable, e.what());
  } catch (const Error& e) {
    PyErr_SetString(g_error, e.what());
  }
}

std::string type_name_of(nb::handle h) { return nb::type_name(h.type()).c_str(); }
bool is_number(nb::handle h) { return PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()); }
}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "optfuse C++ core (nanobind)";
  // A Rule holds its Python update function inside a std::function, out of the garbage collector's
  // sight, so a rule defined at module level (function -> module globals -> rule) stays alive until
  // exit, and nanobind would report it as a leak. That is expected, not a reference-count bug.
  nb::set_leak_warnings(false);

  nb::object error_bases = nb::make_tuple(nb::handle(PyExc_ValueError), nb::handle(PyExc_RuntimeError));
  g_error = PyErr_NewExceptionWithDoc("optfuse.OptfuseError",
                                      "Bad input to optfuse: an unknown name, an invalid value, mismatched tensors.",
                                      error_bases.ptr(), nullptr);
  g_backend_unavailable = PyErr_NewExceptionWithDoc(
      "optfuse.BackendUnavailable", "The backend cannot run here (no GPU, driver, NVRTC or host compiler).",
      PyExc_RuntimeError, nullptr);
  m.attr("OptfuseError") = nb::handle(g_error);
  m.attr("BackendUnavailable") = nb::handle(g_backend_unavailable);
  nb::register_exception_translator(translate_errors, nullptr);

  optfuse::py::bind_rules(m);
  optfuse::py::bind_optimizer(m);
  optfuse::py::bind_table_watch(m);
  optfuse::py::bind_dlpack_exchange(m);
  optfuse::py::bind_matrix(m);
  m.def("q8_storage_bytes", [](int64_t n) { return q8_storage_bytes(n); }, "numel"_a,
        "Bytes of a q8 (block-quantized 8-bit) state of numel elements: the codes, padding, the block scales.");
  m.attr("q8_block") = kQ8Block;
  m.attr("q8_scales_align") = kQ8ScalesAlign;
  m.def("chunk_elements", [](const std::string& backend) { return chunk_elements(parse_backend(backend)); }, "backend"_a,
        "Elements per chunk of a backend: the unit of partial sums, so of shard cuts.");
  // A step's launch and its bookkeeping (step tensors advanced, host counters) as one C call: the
  // interpreter checks for signals only between bytecodes, so a KeyboardInterrupt arrives before all
  // of them or after all of them, never between (step() is atomic with respect to Ctrl-C).
  m.def("_call_each", [](nb::handle calls) {
    nb::object seq = nb::steal(PySequence_Fast(calls.ptr(), "_call_each: expected a sequence of (callable, args)"));
    if (!seq.is_valid()) throw nb::python_error();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* fn = nullptr;
      PyObject* args = nullptr;
      if (!PyArg_ParseTuple(items[i], "OO!", &fn, &PyTuple_Type, &args)) throw nb::python_error();
      PyObject* r = PyObject_Call(fn, args, nullptr);
      if (!r) throw nb::python_error();
      Py_DECREF(r);
    }
  }, "calls"_a, "Calls each (callable, args) in order within one C call (no bytecode runs between them).");
  m.def("parse_dtype", [](const std::string& s) { return static_cast<int>(parse_dtype(s)); }, "name"_a);
}
