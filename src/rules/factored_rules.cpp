// Adafactor as torch.optim.Adafactor (torch 2.5+) writes it, operation by operation where float32
// rounding depends on it. A matrix (a parameter with a matrix view: torch's grad.dim() > 1) keeps
// one second-moment value per row and per column; a vector has no view and is one column of numel
// rows, so its per-row state is torch's full-size `variance` and the same rule serves both
// (is_matrix picks the estimate). Two element operations differ from torch's by an ulp or two, for
// speed (the parity tests allow 1e-6): the division by the row mean is a multiplication by its
// reciprocal, and CUDA's rsqrt is rsqrtf (as torch's own CUDA rsqrt). The norms are per-tensor
// reductions, the row and column means row and column reductions, the mean of the new row state a per-tensor sum of row values.
#include "rules/factored_rules.h"

namespace optfuse::rules {

namespace {
// Python's max(a, b): a unless b > a (so a when b is NaN), as torch's Adafactor computes its per-tensor
// scalars with Python floats.
Expr py_max(Expr a, Expr b) { return select(b > a, b, a); }
Expr py_max(double a, Expr b) { return py_max(constant(*b.graph, a), b); }
}  // namespace

Rule scale_by_adafactor(double lr, double beta2_decay, double eps1, double eps2, double d) {
  Rule r("scale_by_adafactor");
  r.hyper("lr", lr, Range::non_negative()).hyper("beta2_decay", beta2_decay, Range{-1e308, 0, false, false});
  r.hyper("eps1", eps1, Range::non_negative()).hyper("eps2", eps2, Range::non_negative());
  r.hyper("d", d, Range{1, 1e308, false, false});
  r.row_state("row_var").col_state("col_var");
  return r.update([](RuleBuilder& b) {
    Expr g = b.update(), p = b.param(), t = b.step();
    Expr numel = b.shape(ShapeItem::Numel), rows = b.shape(ShapeItem::Rows), cols = b.shape(ShapeItem::Cols);
    Expr eps1 = b.hyper("eps1");
    // Uniform (float64, as torch's Python floats): 1 - beta2_t and the relative step size.
    Expr one_minus_beta2 = b.name(pow(t, b.hyper("beta2_decay")), "one_minus_beta2");
    Expr rho = b.name(min(b.hyper("lr"), 1.0 / sqrt(t)), "rho");
    // Per tensor: alpha = max(eps2, RMS(param)) * rho, from the parameter before this step.
    // (torch takes Python's max(eps2, rms): a NaN rms gives eps2; py_max below keeps that)
    Expr alpha = b.name(py_max(b.hyper("eps2"), sqrt(tensor_sum_of_squares(p)) / sqrt(numel)) * rho, "alpha");
    // Per row and per column (float32): the means of g^2, lerped into the factored moments.
    Expr row_var = b.name(lerp(b.state("row_var"), row_sum_of_squares(g) / cols, one_minus_beta2), "row_var_new");
    Expr col_var = b.name(lerp(b.state("col_var"), col_sum_of_squares(g) / rows, one_minus_beta2), "col_var_new");
    b.set_state("row_var", row_var);
    b.set_state("col_var", col_var);
    // torch divides each element by the mean; one reciprocal per tensor (float64, rounded once)
    // times each element is within an ulp of it and spares the element passes an IEEE division.
    Expr inv_row_mean = b.name(1.0 / max(tensor_sum(row_var) / rows, eps1), "inv_row_var_mean");
    Expr factored = b.name((row_var * col_var) * inv_row_mean, "var_estimate");
    Expr var = select(b.shape(ShapeItem::IsMatrix), factored, row_var);  // a vector's rows are its elements
    Expr update = b.name(rsqrt(max(var, eps1 * eps1)) * g, "adafactor_update");
    // torch: max(1.0, rms(update) / d) in Python, 1.0 when a NaN gradient made the RMS NaN: the NaN
    // stays in its own elements rather than scaling every element of the tensor to NaN
    Expr denom = b.name(py_max(1.0, sqrt(tensor_sum_of_squares(update)) / (sqrt(numel) * b.hyper("d"))),
                        "clip_denom");
    return update * -(alpha / denom);
  });
}

}  // namespace optfuse::rules
