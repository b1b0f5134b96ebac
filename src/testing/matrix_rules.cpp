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

Rule sum_of_columns() {
  Rule r("sum_of_columns");
  r.col_state("cols").update([](RuleBuilder& b) {
    Expr cols = col_sum_of_squares(b.update());
    b.set_state("cols", cols);
    return b.update() * tensor_sum(cols);
  });
  return r;
}

Rule row_and_column_value_sums() {
  Rule r("row_and_column_value_sums");
  r.row_state("rows").col_state("cols").update([](RuleBuilder& b) {
    Expr g = b.update();
    Expr rows = row_sum_of_squares(g), cols = col_sum_of_squares(g);
    b.set_state("rows", rows);
    b.set_state("cols", cols);
    Expr top = reduce(Op::MaxAbs, cols, Scope::Tensor);
    return g * (tensor_sum(cols) / (1.0 + tensor_sum(rows)) + 0.1 * top / (1.0 + top));
  });
  return r;
}

}  // namespace optfuse::testing
