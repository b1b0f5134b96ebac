// Dead-code elimination: keeps only nodes that the outputs (new parameter, new states, skip, new uniform states) reach.
// Rules compute values they may not use (a name given for readability, a folded branch).
#include "passes/pass_pipeline.h"

namespace optfuse {

Program eliminate_dead_code(const Program& p) {
  std::vector<bool> live(p.graph.size(), false);
  auto mark = [&](NodeId id) {
    if (id != kNoNode) live[static_cast<size_t>(id)] = true;
  };
  mark(p.param_out);
  for (NodeId s : p.state_out) mark(s);
  mark(p.skip);
  for (NodeId u : p.uniform_state_out) mark(u);
  for (size_t i = p.graph.size(); i-- > 0;) {  // inputs precede users: one backward sweep
    if (!live[i]) continue;
    const Node& n = p.graph.node(static_cast<NodeId>(i));
    for (int k = 0; k < op_arity(n.op); ++k) mark(n.in[k]);
  }
  return rebuild(p, [&](Graph& g, const Node& n, NodeId old) -> NodeId {
    return live[static_cast<size_t>(old)] ? g.add(n) : kNoNode;
  });
}

}  // namespace optfuse
