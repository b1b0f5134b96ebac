// Common-subexpression elimination. The graph is hash-consed as it is built, so identical nodes are
// already shared; this pass additionally puts the inputs of commutative ops in a canonical order
// (a*b and b*a become one node: IEEE + and * are commutative, min/max here propagate NaN either way)
// and re-hash-conses after folding has made new duplicates.
#include <algorithm>

#include "passes/pass_pipeline.h"

namespace optfuse {

Program eliminate_common_subexpressions(const Program& p) {
  return rebuild(p, [](Graph& g, Node n, NodeId) -> NodeId {
    if (op_is_commutative(n.op) && n.in[1] < n.in[0]) std::swap(n.in[0], n.in[1]);
    return g.add(n);
  });
}

}  // namespace optfuse
