// Constant folding: an op whose inputs are all constants becomes a constant (evaluated in float64,
// exactly as the scalar phase would), plus the identities that are exact in IEEE arithmetic:
// x*1, 1*x, x/1, x-0, -(-x), select(constant, a, b). (x+0 is not folded: it turns -0 into +0.)
#include <cmath>

#include "passes/pass_pipeline.h"

namespace optfuse {

Program fold_constants(const Program& p) {
  return rebuild(p, [](Graph& g, const Node& n, NodeId) -> NodeId {
    int arity = op_arity(n.op);
    if (arity == 0 || op_is_reduction(n.op)) return g.add(n);
    auto is_const = [&](int k, double* v = nullptr) {
      const Node& x = g.node(n.in[k]);
      if (x.op != Op::Const) return false;
      if (v) *v = x.value;
      return true;
    };
    bool all_const = true;
    double v[3] = {0, 0, 0};
    for (int k = 0; k < arity; ++k) all_const = is_const(k, &v[k]) && all_const;
    if (all_const) {
      Node c;
      c.op = Op::Const;
      c.value = apply_op<double>(n.op, v[0], v[1], v[2]);
      return g.add(c);
    }
    double c0 = 0, c1 = 0;
    switch (n.op) {
      case Op::Mul:
        if (is_const(1, &c1) && c1 == 1.0) return n.in[0];
        if (is_const(0, &c0) && c0 == 1.0) return n.in[1];
        break;
      case Op::Div:
        if (is_const(1, &c1) && c1 == 1.0) return n.in[0];
        break;
      case Op::Sub:
        if (is_const(1, &c1) && c1 == 0.0 && !std::signbit(c1)) return n.in[0];
        break;
      case Op::Neg:
        if (g.node(n.in[0]).op == Op::Neg) return g.node(n.in[0]).in[0];
        break;
      case Op::Select:
        if (is_const(0, &c0)) return c0 != 0.0 ? n.in[1] : n.in[2];
        break;
      default:
        break;
    }
    return g.add(n);
  });
}

}  // namespace optfuse
