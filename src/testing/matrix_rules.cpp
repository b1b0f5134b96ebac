#include "testing/matrix_rules.h"

#include "optfuse/builtin_rules.h"

namespace optfuse::testing {

Rule row_and_column_max() {
  Rule mx("row_and_column_max");
  mx.row_state("rows").col_state("cols").update([](RuleBuilder& b) {
    Expr g = b.update();
    Expr rows = reduce(Op::MaxAbs, g, Scope::Row), cols = reduce(Op::MaxAbs, g, Scope::Col);
    b.set_state("rows", rows);
    b.set_state("cols", cols);
    return g * (0.1 + reduce(Op::MaxAbs, rows, Scope::Tensor)) / (1.0 + rows * cols);
  });
  return mx;
}

}  // namespace optfuse::testing
