// optfuse check: runs a chain on a small default set of tensors (several groups, odd sizes) with a
// backend and with the reference evaluator, and reports the largest difference relative to each
// tensor's scale. The README's first demonstration that a backend computes what the plan says.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include "commands.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "testing/device_tensor_set.h"
#include "testing/tensor_set.h"

namespace optfuse::cli {

int check_command(const Argv& args) {
  Options o = parse_options(args, {"backend", "steps", "dtype"}, {});
  std::string spec = o.positional.empty() ? "adamw(lr=1e-2, weight_decay=0.1)" : o.positional[0];
  Backend backend = parse_backend(o.get("backend", "cpu"));
  int steps = std::stoi(o.get("steps", "10"));
  DType dtype = parse_dtype(o.get("dtype", "float32"));
  Chain chain = parse_chain(spec);

  const std::vector<testing::TensorSpec> specs = {{0, 0}, {1, 0}, {3, 1}, {1023, 0}, {65537, 1}, {4096, 1}};
  Optimizer ref(chain, Backend::reference, 2), opt(chain, backend, 2);
  for (Optimizer* x : {&ref, &opt}) x->set_hyper(1, "lr", 0.5 * x->hyper(0, "lr"));
  testing::HostTensorSet ref_set(ref.plan(), specs, dtype, 7), got_set(ref.plan(), specs, dtype, 7);
  ref.set_tensors(ref_set.refs());
  std::unique_ptr<testing::DeviceTensorSet> dev;
  if (backend == Backend::cuda) {
    dev = std::make_unique<testing::DeviceTensorSet>(got_set);
    opt.set_tensors(dev->refs());
  } else {
    opt.set_tensors(got_set.refs());
  }
  std::cout << "chain:   " << ref.plan().program.chain_text << "\nbackend: " << backend_name(backend) << " ("
            << opt.backend_status() << ")\ntensors: 6 (sizes 0, 1, 3, 1023, 65537, 4096) in 2 groups, "
            << dtype_name(dtype) << "\n";
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    ref_set.randomize_grads(100 + static_cast<uint64_t>(s));
    got_set.randomize_grads(100 + static_cast<uint64_t>(s));
    if (dev) dev->upload_role(got_set, 1);
    ref.step();
    opt.step();
    if (dev) dev->download(got_set);
    double d = testing::max_relative_difference(got_set, ref_set);
    worst = std::isnan(d) || d > worst ? d : worst;
    std::printf("  step %2d: max difference relative to tensor scale %.3g\n", s + 1, d);
  }
  // float64: float64 math on both sides, only the order of operations differs.
  double tol = dtype == DType::f64 ? 1e-12 : dtype == DType::f32 ? 1e-5 : 2e-2;
  bool ok = !std::isnan(worst) && worst <= tol;
  std::printf("%s: worst %.3g (tolerance %.0e) after %d steps\n", ok ? "OK" : "MISMATCH", worst, tol, steps);
  return ok ? 0 : 1;
}

}  // namespace optfuse::cli
