// The matrix phase (include/optfuse/newton_schulz.h): optfuse._core.NewtonSchulz. The torch front end
// (optfuse/torch/_muon.py) hands it the data pointer of a contiguous (batch, rows, cols) scratch
// tensor it owns and checks, and the current CUDA stream, as integers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "bindings/common.h"
#include "optfuse/newton_schulz.h"

using namespace nb::literals;

namespace optfuse::py {

void bind_matrix(nb::module_& m) {
  m.def("gemm_available", [](const std::string& backend) {
        std::string why;
        bool ok = gemm_available(parse_backend(backend), &why);
        return nb::make_tuple(ok, why);
      }, "backend"_a, "(available, why): whether the matrix phase's GEMM library loads for the backend.");
  nb::class_<NewtonSchulz>(m, "NewtonSchulz",
                           "Newton-Schulz orthogonalisation of a batch of same-shape matrices, in place, as "
                           "torch.optim.Muon computes it (bf16 products through cuBLAS or OpenBLAS).")
      .def("__init__", [](NewtonSchulz* self, const std::string& backend, int dtype, int64_t batch, int64_t rows,
                          int64_t cols, std::tuple<double, double, double> coefficients, int steps, double eps) {
             NewtonSchulzOptions o;
             o.coefficients = {std::get<0>(coefficients), std::get<1>(coefficients), std::get<2>(coefficients)};
             o.steps = steps;
             o.eps = eps;
             nb::gil_scoped_release release;  // the first CUDA one compiles its kernels
             new (self) NewtonSchulz(parse_backend(backend), {static_cast<DType>(dtype), batch, rows, cols}, o);
           }, "backend"_a, "dtype"_a, "batch"_a, "rows"_a, "cols"_a, "coefficients"_a, "steps"_a, "eps"_a)
      .def("run", [](NewtonSchulz& self, uintptr_t data, uintptr_t stream) {
             nb::gil_scoped_release release;  // the CPU products take a while; CUDA only queues
             self.run(reinterpret_cast<void*>(data), reinterpret_cast<void*>(stream));
           }, "data"_a, "stream"_a = 0,
           "Orthogonalises the batch at the data pointer in place (CUDA: queued on the stream).")
      .def_prop_ro("flops", &NewtonSchulz::flops);
}

}  // namespace optfuse::py
