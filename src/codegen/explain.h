// What `optfuse explain SPEC` prints (tools/explain_command.cpp) and optfuse.explain returns: the
// chain, its passes, the IR after them, the plan with its step schedule and, optionally, the
// generated source. A chain with a matrix phase (optfuse/matrix_chain.h) prints both parts so, with
// the matrix phase between them.
#pragma once
#include <string>
#include <vector>

#include "optfuse/plan.h"

namespace optfuse {

// backend: "cpu" or "cuda" (the generated source's dialect).
std::string explain_text(const Chain& chain, const std::string& backend, bool source);
// The generated source alone (`optfuse explain --source-only`): for a chain with a matrix phase, part
// 1's then part 2's, each after a comment line naming it; a part with no generated loop yet is a
// comment saying why.
std::string explain_source(const Chain& chain, const std::string& backend);
// The plans a chain runs as: one, or a matrix chain's two parts (part 1 checked).
std::vector<Plan> explain_plans(const Chain& chain);

}  // namespace optfuse
