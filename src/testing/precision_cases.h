// Shared by the CPU and CUDA low-precision tests: each role's storage for a plan, the option and
// dtype combinations every backend is checked on, and the comparison against the reference.
#pragma once
#include <string>
#include <vector>

#include "codegen/abi.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "testing/tensor_set.h"

namespace optfuse::testing {

// Every role: its dtype, stochastic where asked (low-precision parameter and states only); fixed
// states keep their dtype, a Kahan compensation takes the parameter's.
StorageVariant role_storage(const Plan& plan, DType param, DType grad, DType states, bool stochastic = false);

struct PrecisionCase {
  const char* name;
  Precision prec;
  DType param, grad, states;
  bool stochastic;
};
std::vector<PrecisionCase> precision_cases();

// 2 ulps of the storage type (bfloat16, float16) at the role's scale, 1e-5 for float32.
double ulp_tolerance(DType d);
// Every role the step writes of `got` against `want` (the reference): within ulp_tolerance of its
// storage type relative to its scale; a remainder through the float32 master it rebuilds; a Kahan
// compensation through param + compensation at the parameter's scale (where float32 and float64
// round the parameter to neighbours the compensations differ by that ulp, all of their own scale).
// Returns "" or what failed.
// float32_tolerance: for float32 roles; 1e-5, or more where stochastically rounded low-precision
// states feed them (a state one ulp apart moves the master by lr x 2^-8 of its update).
std::string compare_to_reference(const Plan& plan, const HostTensorSet& got, const HostTensorSet& want,
                                 double float32_tolerance = 1e-5);

// `steps` steps of the loop users write (new gradients each step, from seed * 1000 + step) on a copy
// of `set`, on host backend b, with 2 parameter groups (group 1 at half group 0's lr).
HostTensorSet run_steps(const Chain& c, const Precision& prec, const HostTensorSet& set, Backend b, int steps,
                        uint64_t seed);

}  // namespace optfuse::testing
