#include <cmath>
#include <cstring>

#include "ir/low_precision.h"
#include "optfuse/dtype.h"
#include "optfuse/error.h"
#include "optfuse/ir.h"

namespace optfuse {

namespace {
struct OpInfo {
  const char* name;
  int arity;
};
// Indexed by Op; keep in the enum's order.
constexpr OpInfo kOps[] = {
    {"const", 0},     {"param", 0},     {"grad", 0},        {"state", 0},     {"hyper", 0},
    {"step", 0},      {"global", 0},    {"uniform_state", 0}, {"shape", 0}, {"neg", 1},         {"abs", 1},       {"sign", 1},
    {"sqrt", 1},      {"rsqrt", 1},     {"exp", 1},         {"log", 1},       {"not", 1},
    {"isfinite", 1},  {"round_bf16", 1}, {"round_f16", 1},  {"add", 2},       {"sub", 2},
    {"mul", 2},       {"div", 2},       {"pow", 2},         {"min", 2},       {"max", 2},
    {"lt", 2},        {"le", 2},        {"gt", 2},          {"ge", 2},        {"eq", 2},
    {"ne", 2},        {"and", 2},       {"or", 2},          {"select", 3},    {"lerp", 3},
    {"fma", 3},       {"master_from_remainder", 2}, {"remainder_of_master", 1},
    {"param_of_master", 1},             {"sum_squares", 1}, {"any_nonfinite", 1}, {"sum", 1}, {"max_abs", 1},
};
static_assert(sizeof(kOps) / sizeof(kOps[0]) == static_cast<size_t>(Op::MaxAbs) + 1,
              "kOps must list every Op");
}  // namespace

const char* op_name(Op op) { return kOps[static_cast<int>(op)].name; }
int op_arity(Op op) { return kOps[static_cast<int>(op)].arity; }
bool op_is_leaf(Op op) { return op_arity(op) == 0; }
bool op_is_reduction(Op op) {
  return op == Op::SumSquares || op == Op::AnyNonFinite || op == Op::Sum || op == Op::MaxAbs;
}
bool op_is_commutative(Op op) {
  switch (op) {
    case Op::Add: case Op::Mul: case Op::Min: case Op::Max: case Op::Eq: case Op::Ne:
    case Op::And: case Op::Or:
      return true;
    default:
      return false;
  }
}

bool Node::operator==(const Node& o) const {
  // Constants compare by bit pattern so that 0.0 and -0.0 (and NaN payloads) stay distinct.
  return op == o.op && in == o.in && index == o.index &&
         std::memcmp(&value, &o.value, sizeof value) == 0;
}

size_t NodeHash::operator()(const Node& n) const {
  uint64_t bits;
  std::memcpy(&bits, &n.value, sizeof bits);
  size_t h = static_cast<size_t>(n.op) * 1000003u;
  for (NodeId i : n.in) h = h * 31u + static_cast<size_t>(i + 1);
  h = h * 31u + static_cast<size_t>(n.index + 1);
  return h ^ (bits * 0x9e3779b97f4a7c15ull);
}

NodeId Graph::add(const Node& n) {
  for (int k = 0; k < op_arity(n.op); ++k) {
    if (n.in[k] < 0 || static_cast<size_t>(n.in[k]) >= nodes_.size())
      throw Error(std::string("IR: input ") + std::to_string(k) + " of '" + op_name(n.op) +
                  "' is not a node of this graph");
  }
  auto it = index_.find(n);
  if (it != index_.end()) return it->second;
  NodeId id = static_cast<NodeId>(nodes_.size());
  nodes_.push_back(n);
  index_.emplace(n, id);
  return id;
}

Expr constant(Graph& g, double v) {
  Node n;
  n.op = Op::Const;
  n.value = v;
  return {&g, g.add(n)};
}

static Graph& same_graph(std::initializer_list<Expr> xs) {
  Graph* g = nullptr;
  for (const Expr& x : xs) {
    if (!x.valid()) throw Error("IR: an expression is empty (was it default-constructed?)");
    if (g && g != x.graph) throw Error("IR: expressions from different rule graphs were mixed");
    g = x.graph;
  }
  return *g;
}

Expr make(Op op, Expr x) {
  Graph& g = same_graph({x});
  Node n;
  n.op = op;
  n.in[0] = x.id;
  if (op_is_reduction(op)) n.index = static_cast<int32_t>(Scope::Global);
  return {&g, g.add(n)};
}
Expr make(Op op, Expr x, Expr y) {
  Graph& g = same_graph({x, y});
  Node n;
  n.op = op;
  n.in[0] = x.id;
  n.in[1] = y.id;
  return {&g, g.add(n)};
}
Expr make(Op op, Expr x, Expr y, Expr z) {
  Graph& g = same_graph({x, y, z});
  Node n;
  n.op = op;
  n.in = {x.id, y.id, z.id};
  return {&g, g.add(n)};
}

static Expr c(Expr like, double v) { return constant(*like.graph, v); }

Expr operator+(Expr a, Expr b) { return make(Op::Add, a, b); }
Expr operator-(Expr a, Expr b) { return make(Op::Sub, a, b); }
Expr operator*(Expr a, Expr b) { return make(Op::Mul, a, b); }
Expr operator/(Expr a, Expr b) { return make(Op::Div, a, b); }
Expr operator-(Expr a) { return make(Op::Neg, a); }
Expr operator+(Expr a, double b) { return a + c(a, b); }
Expr operator+(double a, Expr b) { return c(b, a) + b; }
Expr operator-(Expr a, double b) { return a - c(a, b); }
Expr operator-(double a, Expr b) { return c(b, a) - b; }
Expr operator*(Expr a, double b) { return a * c(a, b); }
Expr operator*(double a, Expr b) { return c(b, a) * b; }
Expr operator/(Expr a, double b) { return a / c(a, b); }
Expr operator/(double a, Expr b) { return c(b, a) / b; }
Expr operator<(Expr a, Expr b) { return make(Op::Lt, a, b); }
Expr operator<=(Expr a, Expr b) { return make(Op::Le, a, b); }
Expr operator>(Expr a, Expr b) { return make(Op::Gt, a, b); }
Expr operator>=(Expr a, Expr b) { return make(Op::Ge, a, b); }
Expr operator==(Expr a, Expr b) { return make(Op::Eq, a, b); }
Expr operator!=(Expr a, Expr b) { return make(Op::Ne, a, b); }
Expr operator==(Expr a, double b) { return a == c(a, b); }
Expr operator!=(Expr a, double b) { return a != c(a, b); }
Expr operator<(Expr a, double b) { return a < c(a, b); }
Expr operator>(Expr a, double b) { return a > c(a, b); }
Expr operator&&(Expr a, Expr b) { return make(Op::And, a, b); }
Expr operator||(Expr a, Expr b) { return make(Op::Or, a, b); }
Expr operator!(Expr a) { return make(Op::Not, a); }

Expr abs(Expr x) { return make(Op::Abs, x); }
Expr sign(Expr x) { return make(Op::Sign, x); }
Expr sqrt(Expr x) { return make(Op::Sqrt, x); }
Expr rsqrt(Expr x) { return make(Op::Rsqrt, x); }
Expr exp(Expr x) { return make(Op::Exp, x); }
Expr log(Expr x) { return make(Op::Log, x); }
Expr pow(Expr x, Expr y) { return make(Op::Pow, x, y); }
Expr pow(Expr x, double y) { return pow(x, c(x, y)); }
Expr pow(double x, Expr y) { return pow(c(y, x), y); }
Expr min(Expr x, Expr y) { return make(Op::Min, x, y); }
Expr min(Expr x, double y) { return min(x, c(x, y)); }
Expr max(Expr x, Expr y) { return make(Op::Max, x, y); }
Expr max(Expr x, double y) { return max(x, c(x, y)); }
Expr select(Expr cond, Expr t, Expr f) { return make(Op::Select, cond, t, f); }
Expr lerp(Expr s, Expr e, Expr w) { return make(Op::Lerp, s, e, w); }
Expr fma(Expr x, Expr y, Expr z) { return make(Op::Fma, x, y, z); }
Expr is_finite(Expr x) { return make(Op::IsFinite, x); }
Expr round_to_bf16(Expr x) { return make(Op::RoundBF16, x); }
Expr round_to_f16(Expr x) { return make(Op::RoundF16, x); }
Expr master_from_remainder(Expr param, Expr remainder) { return make(Op::MasterFromRemainder, param, remainder); }
Expr remainder_of_master(Expr master) { return make(Op::RemainderOfMaster, master); }
Expr param_of_master(Expr master) { return make(Op::ParamOfMaster, master); }
Expr reduce(Op op, Expr x, Scope scope) {
  if (!op_is_reduction(op)) throw Error(std::string("reduce: ") + op_name(op) + " is not a reduction");
  Graph& g = same_graph({x});
  Node n;
  n.op = op;
  n.in[0] = x.id;
  n.index = static_cast<int32_t>(scope);
  return {&g, g.add(n)};
}
Expr global_sum_of_squares(Expr x) { return reduce(Op::SumSquares, x, Scope::Global); }
Expr any_nonfinite(Expr x) { return reduce(Op::AnyNonFinite, x, Scope::Global); }
Expr tensor_sum_of_squares(Expr x) { return reduce(Op::SumSquares, x, Scope::Tensor); }
Expr tensor_any_nonfinite(Expr x) { return reduce(Op::AnyNonFinite, x, Scope::Tensor); }
Expr tensor_sum(Expr x) { return reduce(Op::Sum, x, Scope::Tensor); }
Expr global_max_abs(Expr x) { return reduce(Op::MaxAbs, x, Scope::Global); }
Expr tensor_max_abs(Expr x) { return reduce(Op::MaxAbs, x, Scope::Tensor); }
Expr row_sum_of_squares(Expr x) { return reduce(Op::SumSquares, x, Scope::Row); }
Expr col_sum_of_squares(Expr x) { return reduce(Op::SumSquares, x, Scope::Col); }
Expr tensor_shape(Graph& g, ShapeItem item) {
  Node n;
  n.op = Op::Shape;
  n.index = static_cast<int32_t>(item);
  return {&g, g.add(n)};
}

const char* scope_name(Scope scope) {
  switch (scope) {
    case Scope::Global: return "global";
    case Scope::Tensor: return "tensor";
    case Scope::Row: return "row";
    case Scope::Col: return "column";
  }
  return "?";
}

template <class T>
T apply_op(Op op, T x, T y, T z) {
  switch (op) {
    case Op::Neg: return -x;
    case Op::Abs: return std::fabs(x);
    case Op::Sign: return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x);  // keeps NaN and signed 0
    case Op::Sqrt: return std::sqrt(x);
    case Op::Rsqrt: return T(1) / std::sqrt(x);
    case Op::Exp: return std::exp(x);
    case Op::Log: return std::log(x);
    case Op::Not: return x == T(0) ? T(1) : T(0);
    case Op::IsFinite: return std::isfinite(x) ? T(1) : T(0);
    case Op::RoundBF16: return static_cast<T>(bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x))));
    case Op::RoundF16: return static_cast<T>(f16_bits_to_float(float_to_f16_bits(static_cast<float>(x))));
    case Op::Add: return x + y;
    case Op::Sub: return x - y;
    case Op::Mul: return x * y;
    case Op::Div: return x / y;
    case Op::Pow: return std::pow(x, y);
    case Op::Min: return (std::isnan(x) || std::isnan(y)) ? x + y : (y < x ? y : x);
    case Op::Max: return (std::isnan(x) || std::isnan(y)) ? x + y : (y > x ? y : x);
    case Op::Lt: return x < y ? T(1) : T(0);
    case Op::Le: return x <= y ? T(1) : T(0);
    case Op::Gt: return x > y ? T(1) : T(0);
    case Op::Ge: return x >= y ? T(1) : T(0);
    case Op::Eq: return x == y ? T(1) : T(0);
    case Op::Ne: return x != y ? T(1) : T(0);
    case Op::And: return (x != T(0) && y != T(0)) ? T(1) : T(0);
    case Op::Or: return (x != T(0) || y != T(0)) ? T(1) : T(0);
    case Op::Select: return x != T(0) ? y : z;
    case Op::Lerp: return std::fabs(z) < T(0.5) ? x + z * (y - x) : y - (y - x) * (T(1) - z);
    case Op::Fma: return std::fma(x, y, z);
    case Op::MasterFromRemainder:
      return static_cast<T>(lowp::master_from_remainder(static_cast<float>(x), static_cast<float>(y)));
    case Op::RemainderOfMaster: return static_cast<T>(lowp::remainder_of_master(static_cast<float>(x)));
    case Op::ParamOfMaster: return static_cast<T>(lowp::param_of_master(static_cast<float>(x)));
    default:
      throw Error(std::string("IR: apply_op cannot evaluate '") + op_name(op) + "'");
  }
}

template float apply_op<float>(Op, float, float, float);
template double apply_op<double>(Op, double, double, double);

}  // namespace optfuse
