// The rule IR: one node type, hash-consed into a Graph, and an Expr handle with math operators so
// that rules read as math.
//
// Every node has a *kind of value*:
//   element  - one value per tensor element (depends on Param, Grad or State); float32 math
//   uniform  - one value per parameter group for the whole step (hyperparameters, step, globals,
//              reduction results and anything computed from them only); float64 math, rounded to
//              float32 where it meets element values (as torch rounds a Python scalar)
// Semantics of each op (x, y, z are the inputs in order; `a` is the node's `value`, `i` its `index`):
//   Const      a
//   Param      the parameter element before this step
//   Grad       the gradient element
//   State      state slot i before this step
//   Hyper      hyperparameter slot i of the element's parameter group
//   Step       the step number being taken in the element's group: 1 on the first step
//   Global     global scalar i, set by the caller per step (grad_scale, found_inf)
//   UniformState  uniform state slot i of the element's parameter group before this step: one float64
//              per group kept across steps (NAdam's mu_product); its new value is a uniform output
//              of the program, committed where the step is not skipped (as the step count)
//   Neg -x   Abs |x|   Sign: -1, 0 or 1 (NaN stays NaN)   Sqrt   Exp   Log (natural)
//   Rsqrt 1/sqrt(x); CUDA's float element math uses rsqrtf (within 2 ulp, as torch's CUDA rsqrt)
//   Not: 1 if x == 0 else 0        IsFinite: 1 if x is neither inf nor NaN else 0
//   Add Sub Mul Div: IEEE arithmetic in the node's precision (no contraction into fma)
//   Pow x^y (std::pow)   Min Max: NaN if either input is NaN (torch.minimum/maximum)
//   Lt Le Gt Ge Eq Ne: 1 or 0        And Or: logical on (x != 0), result 1 or 0
//   Select: y if x != 0 else z
//   Lerp: x + z*(y - x) computed as torch.lerp does: |z| < 0.5 ? x + z*(y-x) : y - (y-x)*(1-z)
//   Fma: x*y + z with one rounding
//   RoundBF16 / RoundF16: x rounded to bfloat16 / float16 precision (to mimic low-precision storage)
//   Master-weight remainders (element values only; x is first rounded to float32; exact bit
//   definitions in src/ir/low_precision_code.h): MasterFromRemainder: the float32 master whose
//   bfloat16 parameter is x and int16 remainder y; RemainderOfMaster: x's remainder (an integer in
//   [-32768, 32767]); ParamOfMaster: x's bfloat16 parameter (nearest, ties away from zero)
//   Shape      a number of the element's tensor (a *tensor* value): index 0 numel, 1 rows, 2 columns of
//              its matrix view, 3 whether it has one (TensorRef::cols; a tensor without one is a
//              column: numel rows of 1 column)
//   SumSquares: sum of x*x over the elements of its scope (float64 accumulation, fixed order:
//               deterministic). Input element.
//   Sum: sum of x over its scope (float64, fixed order). Input element, or a row or column value
//        (summed over the tensor's rows or columns).
//   AnyNonFinite: 1 if any element of x in its scope is inf or NaN, else 0. Input element.
//   MaxAbs: the largest |x| over its scope (0 over none); NaN if any x is NaN (torch.max's rule).
// A reduction's `index` is its Scope: Global (every element of every tensor in the step; the result
// is uniform, one value per step), Tensor (the elements of one tensor; the result is one value per
// tensor, a *tensor* value), Row or Col (the elements of one row or one column of the tensor's
// matrix view: a *row* or *column* value, Adafactor's factored second moments). A reduction of
// element values is only known after a full pass over memory: a phase boundary (plan.h). A Sum of
// row or column values over a Tensor needs no pass: it is taken when those values are.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace optfuse {

enum class Op : uint8_t {
  Const, Param, Grad, State, Hyper, Step, Global, UniformState, Shape,
  Neg, Abs, Sign, Sqrt, Rsqrt, Exp, Log, Not, IsFinite, RoundBF16, RoundF16,
  Add, Sub, Mul, Div, Pow, Min, Max, Lt, Le, Gt, Ge, Eq, Ne, And, Or,
  Select, Lerp, Fma,
  MasterFromRemainder, RemainderOfMaster, ParamOfMaster,
  SumSquares, AnyNonFinite, Sum, MaxAbs,
};

const char* op_name(Op op);
int op_arity(Op op);
bool op_is_leaf(Op op);
bool op_is_reduction(Op op);
bool op_is_commutative(Op op);

// The elements a reduction runs over (its node's `index`).
enum class Scope : int32_t { Global = 0, Tensor = 1, Row = 2, Col = 3 };
// Shape's index.
enum class ShapeItem : int32_t { Numel = 0, Rows = 1, Cols = 2, IsMatrix = 3 };
const char* scope_name(Scope scope);

using NodeId = int32_t;
constexpr NodeId kNoNode = -1;

struct Node {
  Op op = Op::Const;
  std::array<NodeId, 3> in{kNoNode, kNoNode, kNoNode};
  double value = 0;     // Const
  int32_t index = -1;   // State, Hyper, Global, UniformState slot; a reduction's Scope
  bool operator==(const Node& o) const;
};

inline Scope reduction_scope(const Node& n) { return static_cast<Scope>(n.index); }

struct NodeHash {
  size_t operator()(const Node& n) const;
};

// Append-only, hash-consed: adding a node equal to an existing one returns the existing id, so
// common subexpressions are shared as the graph is built. Inputs always precede their users, so
// ids are a topological order.
class Graph {
 public:
  NodeId add(const Node& n);
  const Node& node(NodeId id) const { return nodes_.at(static_cast<size_t>(id)); }
  size_t size() const { return nodes_.size(); }
  const std::vector<Node>& nodes() const { return nodes_; }

 private:
  std::vector<Node> nodes_;
  std::unordered_map<Node, NodeId, NodeHash> index_;
};

// A handle to a node of a graph, with operators, so rules are written as math.
struct Expr {
  Graph* graph = nullptr;
  NodeId id = kNoNode;
  bool valid() const { return graph != nullptr && id != kNoNode; }
};

Expr constant(Graph& g, double v);
Expr make(Op op, Expr x);
Expr make(Op op, Expr x, Expr y);
Expr make(Op op, Expr x, Expr y, Expr z);

Expr operator+(Expr a, Expr b);
Expr operator-(Expr a, Expr b);
Expr operator*(Expr a, Expr b);
Expr operator/(Expr a, Expr b);
Expr operator-(Expr a);
Expr operator+(Expr a, double b);
Expr operator+(double a, Expr b);
Expr operator-(Expr a, double b);
Expr operator-(double a, Expr b);
Expr operator*(Expr a, double b);
Expr operator*(double a, Expr b);
Expr operator/(Expr a, double b);
Expr operator/(double a, Expr b);
Expr operator<(Expr a, Expr b);
Expr operator<=(Expr a, Expr b);
Expr operator>(Expr a, Expr b);
Expr operator>=(Expr a, Expr b);
Expr operator==(Expr a, Expr b);
Expr operator!=(Expr a, Expr b);
Expr operator==(Expr a, double b);
Expr operator!=(Expr a, double b);
Expr operator<(Expr a, double b);
Expr operator>(Expr a, double b);
Expr operator&&(Expr a, Expr b);
Expr operator||(Expr a, Expr b);
Expr operator!(Expr a);

Expr abs(Expr x);
Expr sign(Expr x);
Expr sqrt(Expr x);
Expr rsqrt(Expr x);
Expr exp(Expr x);
Expr log(Expr x);
Expr pow(Expr x, Expr y);
Expr pow(Expr x, double y);
Expr pow(double x, Expr y);
Expr min(Expr x, Expr y);
Expr min(Expr x, double y);
Expr max(Expr x, Expr y);
Expr max(Expr x, double y);
Expr select(Expr cond, Expr if_true, Expr if_false);
Expr lerp(Expr start, Expr end, Expr weight);
Expr fma(Expr x, Expr y, Expr z);
Expr is_finite(Expr x);
Expr round_to_bf16(Expr x);
Expr round_to_f16(Expr x);
Expr master_from_remainder(Expr param, Expr remainder);
Expr remainder_of_master(Expr master);
Expr param_of_master(Expr master);
Expr global_sum_of_squares(Expr x);
Expr any_nonfinite(Expr x);
// Per-tensor reductions: one value per tensor (LAMB's and LARS's norms).
Expr tensor_sum_of_squares(Expr x);
Expr tensor_any_nonfinite(Expr x);
Expr tensor_sum(Expr x);
// The largest |x| over every element of the step / of one tensor (a global / per-tensor value).
Expr global_max_abs(Expr x);
Expr tensor_max_abs(Expr x);
// Per row and per column of the tensor's matrix view (Adafactor's factored second moments).
Expr row_sum_of_squares(Expr x);
Expr col_sum_of_squares(Expr x);
Expr reduce(Op op, Expr x, Scope scope);
// The tensor's element count, rows, columns and whether it has a matrix view (Op::Shape).
Expr tensor_shape(Graph& g, ShapeItem item);

// Evaluates one non-leaf, non-reduction op on already-evaluated inputs, in precision T (double for
// uniform values and the reference evaluator, float for element values). The single definition of
// op semantics that the interpreter uses; generated code mirrors it in each dialect's prelude.
template <class T>
T apply_op(Op op, T x, T y, T z);

}  // namespace optfuse
