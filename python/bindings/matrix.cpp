// The matrix phase: optfuse._core.NewtonSchulz (include/optfuse/newton_schulz.h; the torch front end,
// optfuse/torch/_muon.py, hands it the data pointer of a contiguous (batch, rows, cols) scratch
// tensor it owns and checks, and the current CUDA stream, as integers) and MatrixChainOptimizer
// (include/optfuse/matrix_chain.h) over DLPack arrays.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <vector>

#include "bindings/common.h"
#include "bindings/arrays.h"
#include "optfuse/error.h"
#include "optfuse/matrix_chain.h"
#include "optfuse/newton_schulz.h"

using namespace nb::literals;

namespace optfuse::py {

namespace {

// MatrixChainOptimizer over DLPack arrays (NumPy, torch, CuPy...): every parameter a 2-D array.
class PyMatrixChain {
 public:
  PyMatrixChain(nb::handle chain, const std::string& backend, int groups) {
    Chain c = to_chain(chain);
    Backend b = parse_backend(backend);
    nb::gil_scoped_release release;
    opt_ = std::make_unique<MatrixChainOptimizer>(c, b, groups);
  }
  MatrixChainOptimizer& get() { return *opt_; }

  // (param, grad, [states], group): param a 2-D array (its matrix), the rest of its size.
  void set_tensors(nb::handle items) {
    const std::vector<ProgramState> states = opt_->states();
    std::vector<TensorRef> refs;
    std::vector<nb::object> keep;
    int dev_id = -1;
    size_t t = 0;
    for (nb::handle item : items) {
      const std::string where = "tensor " + std::to_string(t++);
      nb::ndarray<nb::ro> param;
      TensorRef r = read_tensor_item(item, where, states, opt_->backend(), dev_id, keep, &param);
      if (param.ndim() != 2)
        throw Error(where + ": param has shape " + describe_shape(param) + "; a chain with a matrix phase steps 2-D matrices");
      r.cols = static_cast<int64_t>(param.shape(1));
      refs.push_back(r);
    }
    opt_->set_tensors(refs);
    keep_ = std::move(keep);
  }

  void step(nb::handle stream) {
    StepInputs in;
    if (!stream.is_none()) {
      if (opt_->backend() != Backend::cuda) throw Error("step(stream=...) is for the cuda backend");
      in.stream = reinterpret_cast<void*>(nb::cast<uint64_t>(stream));
    }
    nb::gil_scoped_release release;
    opt_->step(in);
  }

 private:
  std::unique_ptr<MatrixChainOptimizer> opt_;
  std::vector<nb::object> keep_;  // the arrays of the tensor set
};

}  // namespace

void bind_matrix(nb::module_& m) {
  nb::class_<PyMatrixChain>(m, "MatrixChainOptimizer",
                            "A chain with a matrix phase (e.g. 'muon(lr=0.02)'): part 1's passes, Newton-Schulz of "
                            "every 2-D parameter's update (batched by shape), part 2's passes.")
      .def(nb::init<nb::handle, const std::string&, int>(), "chain"_a, "backend"_a = "cpu", "groups"_a = 1)
      .def("set_tensors", &PyMatrixChain::set_tensors, "tensors"_a,
           "[(param, grad, [states], group?)], param a 2-D array; states in state_names order, zero-filled.")
      .def("step", &PyMatrixChain::step, "stream"_a = nb::none())
      .def("set_hyper", [](PyMatrixChain& o, int group, const std::string& name, double v) { o.get().set_hyper(group, name, v); },
           "group"_a, "name"_a, "value"_a)
      .def("hyper", [](PyMatrixChain& o, int group, const std::string& name) { return o.get().hyper(group, name); },
           "group"_a, "name"_a)
      .def("step_count", [](PyMatrixChain& o, int group) { return o.get().step_count(group); }, "group"_a)
      .def("describe", [](PyMatrixChain& o) { return o.get().describe(); })
      .def_prop_ro("state_names", [](PyMatrixChain& o) {
        std::vector<std::string> out;
        for (const ProgramState& s : o.get().states()) out.push_back(s.name);
        return out;
      });
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
