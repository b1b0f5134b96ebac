// The pass pipeline: free functions Program -> Program, run in order from one table.
// OPTFUSE_DUMP_IR=1 prints the IR after every pass to stderr.
#pragma once
#include <string>
#include <vector>

#include "optfuse/rule.h"

namespace optfuse {

Program fold_constants(const Program& p);
Program eliminate_common_subexpressions(const Program& p);
Program eliminate_dead_code(const Program& p);

struct Pass {
  const char* name;
  Program (*run)(const Program&);
};
const std::vector<Pass>& pass_pipeline();

// Runs every pass; appends "name: N nodes" to *log when given.
Program run_passes(Program p, std::vector<std::string>* log = nullptr);

// Shared by the passes: rebuilds a program node by node into a fresh graph. `rewrite` receives the
// node with inputs already mapped into the new graph and returns its new id (usually g.add(n)).
template <class Fn>
Program rebuild(const Program& in, Fn rewrite);

}  // namespace optfuse

#include "passes/rebuild_impl.h"
