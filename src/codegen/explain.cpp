#include "codegen/explain.h"

#include <sstream>

#include "codegen/cpu_source.h"
#include "codegen/cuda_source.h"
#include "optfuse/error.h"
#include "optfuse/matrix_chain.h"

namespace optfuse {

namespace {

void check_backend(const std::string& backend) {
  if (backend != "cpu" && backend != "cuda") throw Error("explain: backend must be 'cpu' or 'cuda', got '" + backend + "'");
}

// The plan's generated source; `none_prefix` starts the line that says a matrix plan has none yet.
std::string source_text(const Plan& plan, const std::string& backend, const char* none_prefix) {
  try {
    return backend == "cuda" ? generate_cuda_source(plan) : generate_cpu_source(plan);
  } catch (const Error& e) {
    if (!plan.matrix()) throw;
    return std::string(none_prefix) + "(none: " + e.what() + ")\n";  // no generated loop for this plan yet: say so
  }
}

std::string plan_text(const Plan& plan, const std::string& backend, bool source) {
  std::ostringstream o;
  o << "== chain\n" << plan.program.chain_text << "\n\n== passes\n";
  for (const auto& line : plan.pass_log) o << "  " << line << "\n";
  o << "\n== IR after passes\n" << print_ir(plan.program, &plan.kind) << "\n== plan\n" << plan.describe();
  if (source) o << "\n== generated " << backend << " source\n" << source_text(plan, backend, "");
  return o.str();
}

}  // namespace

namespace {
std::vector<Plan> part_plans(const MatrixChainParts& parts) {
  std::vector<Plan> plans{make_plan(parts.before), make_plan(parts.after)};
  check_matrix_chain_part1(plans[0]);
  return plans;
}
}  // namespace

std::vector<Plan> explain_plans(const Chain& chain) {
  if (!has_matrix_phase(chain)) return {make_plan(chain)};
  return part_plans(split_matrix_chain(chain));
}

std::string explain_source(const Chain& chain, const std::string& backend) {
  check_backend(backend);
  if (!has_matrix_phase(chain)) return source_text(make_plan(chain), backend, "// ");
  const std::vector<Plan> plans = explain_plans(chain);
  std::ostringstream o;
  for (size_t i = 0; i < plans.size(); ++i)
    o << (i ? "\n" : "") << "// ######## part " << i + 1 << " of " << plans.size()
      << " (the matrix phase runs between them)\n" << source_text(plans[i], backend, "// ");
  return o.str();
}

std::string explain_text(const Chain& chain, const std::string& backend, bool source) {
  check_backend(backend);
  if (!has_matrix_phase(chain)) return plan_text(make_plan(chain), backend, source);
  const MatrixChainParts parts = split_matrix_chain(chain);
  const std::vector<Plan> plans = part_plans(parts);
  std::ostringstream o;
  o << "A chain with a matrix phase (optfuse::MatrixChainOptimizer): part 1's schedule, the matrix phase, part 2's "
       "schedule.\n\n######## part 1 (its parameter role is each tensor's scratch matrix: its update pass writes "
       "the update there)\n"
    << plan_text(plans[0], backend, source) << "\n######## matrix phase\n" << parts.matrix_signature
    << ": per tensor, bfloat16 Newton-Schulz of the scratch matrix (transposed if tall), batched over same-shape "
       "matrices: "
    << (backend == "cuda" ? "cuBLAS strided-batched bf16 GEMMs with float32 accumulation"
                          : "OpenBLAS sgemm on bf16 values, each result rounded to bf16")
    << "; " << 3 * parts.matrix.steps << " products per batch\n\n######## part 2 (its gradient role is the orthogonalised scratch)\n"
    << plan_text(plans[1], backend, source);
  return o.str();
}

}  // namespace optfuse
