#include "passes/pass_pipeline.h"

#include <cstdlib>
#include <iostream>

#include "optfuse/plan.h"

namespace optfuse {

const std::vector<Pass>& pass_pipeline() {
  static const std::vector<Pass> passes = {
      {"fold_constants", fold_constants},
      {"eliminate_common_subexpressions", eliminate_common_subexpressions},
      {"eliminate_dead_code", eliminate_dead_code},
  };
  return passes;
}

Program run_passes(Program p, std::vector<std::string>* log) {
  const char* dump = std::getenv("OPTFUSE_DUMP_IR");
  bool dumping = dump && *dump && std::string(dump) != "0";
  if (log) log->push_back("built: " + std::to_string(p.graph.size()) + " nodes");
  if (dumping) std::cerr << "== IR as built\n" << print_ir(p);
  for (const Pass& pass : pass_pipeline()) {
    p = pass.run(p);
    if (log) log->push_back(std::string(pass.name) + ": " + std::to_string(p.graph.size()) + " nodes");
    if (dumping) std::cerr << "== IR after " << pass.name << "\n" << print_ir(p);
  }
  return p;
}

}  // namespace optfuse
