// What the binding files share: nanobind, the functions one file uses from another, and the
// registration function of each file (python/bindings/module.cpp calls them).
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

#include "optfuse/rule.h"

namespace nb = nanobind;

namespace optfuse::py {

std::string type_name_of(nb::handle h);
// A Python int or float (bool included, as Python counts it).
bool is_number(nb::handle h);
// A Python chain (a list of optfuse.Rule, lists of them, or SPEC text) as a Chain.
Chain to_chain(nb::handle h);

// Expr, RuleBuilder, Range, Rule, chains and built-ins, plans and explain (rules.cpp).
void bind_rules(nb::module_& m);
// Optimizer (optimizer.cpp).
void bind_optimizer(nb::module_& m);
// _TableWatch, the torch front end's per-step check of its tables against torch's tensors
// (table_watch.cpp); watch_pointers: a watch's gradient pointers (Optimizer._take_grads reads them).
void bind_table_watch(nb::module_& m);
const std::vector<uint64_t>& watch_pointers(nb::handle watch);
// _set_torch_exchange: torch.Tensor's DLPack C exchange API (dlpack_exchange.cpp).
void bind_dlpack_exchange(nb::module_& m);
// NewtonSchulz, the matrix phase, and gemm_available (matrix.cpp).
void bind_matrix(nb::module_& m);

}  // namespace optfuse::py
