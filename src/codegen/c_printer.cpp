#include "codegen/c_printer.h"

#include "codegen/low_precision_source.h"

#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

namespace optfuse {

namespace {

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '_') ? c : '_';
  if (out.empty() || std::isdigit(static_cast<unsigned char>(out[0]))) out = "v_" + out;
  return out;
}

// A dialect's expression template ("isfinite(%s)") with its one "%s" replaced by `x`.
std::string fill(const char* tmpl, const std::string& x) {
  std::string s = tmpl;
  return s.replace(s.find("%s"), 2, x);
}

std::string literal(double v, bool element) {
  if (std::isnan(v)) return element ? "OF_NANF" : "OF_NAN";
  if (std::isinf(v)) return std::string(v < 0 ? "-" : "") + (element ? "OF_INFF" : "OF_INF");
  char buf[48];
  if (element) {
    std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(static_cast<float>(v)));
  } else {
    std::snprintf(buf, sizeof buf, "%.17g", v);
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return "(" + s + (element ? "f)" : ")");
}

const char* kCommonPrelude = R"(
#define OF_INF (1.0 / 0.0)
#define OF_NAN (0.0 / 0.0)
#define OF_INFF (1.0f / 0.0f)
#define OF_NANF (0.0f / 0.0f)
// Semantics as in include/optfuse/ir.h (the reference evaluator is apply_op there).
// Written as selects of comparisons with no short-circuit (| not ||, no nested ?:): GCC then
// if-converts and vectorizes the CPU loops that use them (Rprop's sign tests ran scalar, with
// data-dependent branches, at a ninth of Adam's speed). The values are those of the plain forms.
OF_FN float of_sign(float x) { const float s = x > 0.0f ? 1.0f : x; return x < 0.0f ? -1.0f : s; }
OF_FN double of_sign(double x) { const double s = x > 0.0 ? 1.0 : x; return x < 0.0 ? -1.0 : s; }
OF_FN float of_min(float x, float y) { const float m = y < x ? y : x; return ((x != x) | (y != y)) ? x + y : m; }
OF_FN double of_min(double x, double y) { const double m = y < x ? y : x; return ((x != x) | (y != y)) ? x + y : m; }
OF_FN float of_max(float x, float y) { const float m = y > x ? y : x; return ((x != x) | (y != y)) ? x + y : m; }
OF_FN double of_max(double x, double y) { const double m = y > x ? y : x; return ((x != x) | (y != y)) ? x + y : m; }
// torch.lerp's two-sided form: exact at both ends.
OF_FN float of_lerp(float a, float b, float w) { return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }
OF_FN double of_lerp(double a, double b, double w) { return fabs(w) < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w); }
OF_FN unsigned of_f2u(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
OF_FN float of_u2f(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
OF_FN float of_bf16_to_float(unsigned short b) { return of_u2f((unsigned)b << 16); }
OF_FN unsigned short of_float_to_bf16(float f) {
  unsigned u = of_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
OF_FN float of_f16_to_float(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (ex == 0) { float f = (float)man * 5.9604644775390625e-8f; return sign ? -f : f; }
  return of_u2f(ex == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((ex + 112) << 23) | (man << 13)));
}
OF_FN unsigned short of_float_to_f16(float f) {
  unsigned x = of_f2u(f), sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);
  if (mag >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
  if (mag < 0x38800000u) { unsigned r = of_f2u(of_u2f(mag) + 0.5f); return (unsigned short)(sign | (r - 0x3f000000u)); }
  mag += 0xc8000fffu + ((mag >> 13) & 1u);
  return (unsigned short)(sign | (mag >> 13));
}
OF_FN float of_round_bf16(float x) { return of_bf16_to_float(of_float_to_bf16(x)); }
OF_FN double of_round_bf16(double x) { return of_bf16_to_float(of_float_to_bf16((float)x)); }
OF_FN float of_round_f16(float x) { return of_f16_to_float(of_float_to_f16(x)); }
OF_FN double of_round_f16(double x) { return of_f16_to_float(of_float_to_f16((float)x)); }
)";

// The chain's text without hyperparameter values: "scale_by_adam(b1, b2, eps, amsgrad=true)".
// Values are run-time data (the scalar table), never code; keeping them out of the source means
// that chains differing only in their values (adamw(lr=1e-3) vs adamw(lr=3e-4)) generate the same
// text and so share one compiled object in the disk cache instead of compiling again.
std::string chain_structure(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '=') {
      size_t j = i + 1;
      while (j < text.size() && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '.' ||
                                 text[j] == '-' || text[j] == '+'))
        ++j;
      std::string value = text.substr(i + 1, j - i - 1);
      if (value != "true" && value != "false") {  // a number (also inf, nan): dropped with its '='
        i = j - 1;
        continue;
      }
    }
    out += text[i];
  }
  return out;
}

}  // namespace

std::string c_literal(double v, bool element) { return literal(v, element); }

std::vector<std::string> role_names(const Plan& plan) {
  std::vector<std::string> r{"param", "grad"};
  std::set<std::string> short_names;
  int dup = 0;
  for (auto& s : plan.program.states) dup += !short_names.insert(s.name).second;
  for (auto& s : plan.program.states) r.push_back(sanitize(dup ? s.qualified : s.name));
  return r;
}

CPrinter::CPrinter(const Plan& plan, const Dialect& dialect) : plan_(plan), d_(dialect) {
  const Program& p = plan.program;
  std::set<std::string> used;
  std::vector<std::string> roles = role_names(plan);
  for (auto& r : roles) used.insert(r);
  names_.resize(p.graph.size());
  for (size_t i = 0; i < p.graph.size(); ++i) {
    const Node& n = p.graph.node(static_cast<NodeId>(i));
    std::string base;
    if (n.op == Op::Param) { names_[i] = "param"; continue; }
    if (n.op == Op::Grad) { names_[i] = "grad"; continue; }
    if (n.op == Op::State) { names_[i] = roles[2 + static_cast<size_t>(n.index)]; continue; }
    auto it = p.names.find(static_cast<NodeId>(i));
    if (it != p.names.end()) base = sanitize(it->second);
    else if (n.op == Op::Hyper) base = sanitize(p.hypers[static_cast<size_t>(n.index)].name);
    else if (n.op == Op::Step) base = "step";
    else if (n.op == Op::Global) base = global_name(n.index);
    else if (n.op == Op::UniformState) base = sanitize(p.uniform_states[static_cast<size_t>(n.index)].name);
    else base = "t" + std::to_string(i);
    std::string name = base;
    for (int k = 2; used.count(name); ++k) name = base + "_" + std::to_string(k);
    used.insert(name);
    names_[i] = name;
  }
}

std::string CPrinter::value_name(NodeId id) const { return names_[static_cast<size_t>(id)]; }

// The right-hand side of node `id`; `element` selects float (element) or double (uniform) math.
std::string CPrinter::expr(NodeId id, bool element) const {
  const Node& n = plan_.program.graph.node(id);
  auto in = [&](int k) {
    const Node& x = plan_.program.graph.node(n.in[k]);
    return x.op == Op::Const ? literal(x.value, element) : value_name(n.in[k]);
  };
  const char* f = element ? "f" : "";
  std::string one = element ? "1.0f" : "1.0", zero = element ? "0.0f" : "0.0";
  auto cmp = [&](const char* o) { return "(" + in(0) + " " + o + " " + in(1) + " ? " + one + " : " + zero + ")"; };
  switch (n.op) {
    case Op::Const: return literal(n.value, element);
    case Op::Neg: return "-" + in(0);
    case Op::Abs: return std::string("fabs") + f + "(" + in(0) + ")";
    case Op::Sign: return "of_sign(" + in(0) + ")";
    case Op::Sqrt: return std::string("sqrt") + f + "(" + in(0) + ")";
    case Op::Rsqrt: {
      if (!element) return "1.0 / sqrt(" + in(0) + ")";
      return fill(d_.rsqrt_float, in(0));
    }
    case Op::Exp: return std::string("exp") + f + "(" + in(0) + ")";
    case Op::Log: return std::string("log") + f + "(" + in(0) + ")";
    case Op::Not: return "(" + in(0) + " == " + zero + " ? " + one + " : " + zero + ")";
    case Op::IsFinite: return "(" + fill(d_.is_finite, in(0)) + " ? " + one + " : " + zero + ")";
    case Op::RoundBF16: return "of_round_bf16(" + in(0) + ")";
    case Op::RoundF16: return "of_round_f16(" + in(0) + ")";
    case Op::Add: return in(0) + " + " + in(1);
    case Op::Sub: return in(0) + " - " + in(1);
    case Op::Mul: return in(0) + " * " + in(1);
    case Op::Div: return in(0) + " / " + in(1);
    case Op::Pow: return std::string("pow") + f + "(" + in(0) + ", " + in(1) + ")";
    case Op::Min: return "of_min(" + in(0) + ", " + in(1) + ")";
    case Op::Max: return "of_max(" + in(0) + ", " + in(1) + ")";
    case Op::Lt: return cmp("<");
    case Op::Le: return cmp("<=");
    case Op::Gt: return cmp(">");
    case Op::Ge: return cmp(">=");
    case Op::Eq: return cmp("==");
    case Op::Ne: return cmp("!=");
    // (& and | of the comparisons, not && and ||: no branch, see of_sign)
    case Op::And: return "((" + in(0) + " != " + zero + ") & (" + in(1) + " != " + zero + ") ? " + one + " : " + zero + ")";
    case Op::Or: return "((" + in(0) + " != " + zero + ") | (" + in(1) + " != " + zero + ") ? " + one + " : " + zero + ")";
    case Op::Select: return "(" + in(0) + " != " + zero + " ? " + in(1) + " : " + in(2) + ")";
    case Op::Lerp: return "of_lerp(" + in(0) + ", " + in(1) + ", " + in(2) + ")";
    case Op::Fma: return std::string("fma") + f + "(" + in(0) + ", " + in(1) + ", " + in(2) + ")";
    // Element-only ops (bit manipulations of float32 values): the float forms in every context.
    case Op::MasterFromRemainder: return "of_master_from_remainder((float)" + in(0) + ", (float)" + in(1) + ")";
    case Op::RemainderOfMaster: return "of_remainder_of_master((float)" + in(0) + ")";
    case Op::ParamOfMaster: return "of_param_of_master((float)" + in(0) + ")";
    default: return "/* unprintable " + std::string(op_name(n.op)) + " */";
  }
}

std::string CPrinter::header_comment() const {
  std::ostringstream s;
  s << "// optfuse generated source (" << d_.name << " backend)\n// chain: " << chain_structure(plan_.program.chain_text)
    << "\n";
  for (size_t i = 0; i < plan_.phases.size(); ++i) {
    const ElementPhase& ph = plan_.phases[i];
    s << "// phase " << i << ": " << (ph.kind == ElementPhase::Kind::Reduce ? "reduce" : "update") << ", "
      << ph.reads() << " reads + " << ph.writes() << " writes per element\n";
  }
  s << "// Do not edit: regenerate with `optfuse explain`.\n";
  return s.str();
}

std::string dialect_prelude(const Dialect& d) {
  return std::string("#define OF_FN ") + d.fn_qualifier + "\n" + d.extra_prelude + kCommonPrelude;
}

std::string CPrinter::prelude() const { return dialect_prelude(d_) + low_precision_source(); }

std::string element_function_name(const Plan& plan, size_t phase, bool states_ahead, bool f64) {
  const bool recomputing = !states_ahead && plan.has_recomputing_form(phase);
  return "of_phase" + std::to_string(phase) + (recomputing ? "_element_recomputing" : "_element") + f64_suffix(f64);
}

std::string CPrinter::element_function(size_t phase, bool f64) const {
  std::string s = element_function(phase, true, f64);
  if (plan_.has_recomputing_form(phase)) s += element_function(phase, false, f64);
  return s;
}

std::string CPrinter::element_function(size_t phase, bool states_ahead, bool f64) const {
  const ElementPhase& ph = plan_.phase_for(phase, states_ahead);
  const Program& p = plan_.program;
  std::vector<std::string> roles = role_names(plan_);
  // float32 element math, or (f64) float64: the printer's uniform (double) forms of every op.
  const std::string T = f64 ? "double" : "float";
  const bool element = !f64;
  std::ostringstream s;
  s << "\n// phase " << phase << " (" << (ph.kind == ElementPhase::Kind::Reduce ? "reduce" : "update")
    << (states_ahead ? "" : "; the form for states written ahead in 16 bits, Plan::recomputing")
    << "): per element, " << (f64 ? "float64" : "float32") << " math\n";
  s << "OF_FN void " << element_function_name(plan_, phase, states_ahead, f64) << "(" << T << "* v, const " << T
    << "* u, double* acc) {\n";
  if (ph.reads_param) s << "  const " << T << " param = v[0];\n";
  if (ph.reads_grad) s << "  const " << T << " grad = v[1];\n";
  for (int st : ph.reads_states) {  // a state's old value, or its new one where an earlier pass wrote it
    NodeId loaded = kNoNode;
    for (const auto& [node, state] : ph.loads)
      if (state == st) loaded = node;
    s << "  const " << T << " " << (loaded == kNoNode ? roles[2 + static_cast<size_t>(st)] : value_name(loaded)) << " = v["
      << 2 + st << "];\n";
  }
  std::set<NodeId> declared;
  for (NodeId id : ph.nodes) {
    const Node& n = p.graph.node(id);
    if (ph.load_of(id) >= 0) continue;  // read from its role: its inputs are not needed
    for (int k = 0; k < op_arity(n.op); ++k) {
      NodeId x = n.in[k];
      auto slot = plan_.derived_slot.find(x);
      if (slot != plan_.derived_slot.end() && declared.insert(x).second)
        s << "  const " << T << " " << value_name(x) << " = u[" << slot->second << "];\n";
    }
  }
  for (NodeId id : ph.nodes) {
    const Node& n = p.graph.node(id);
    if (op_is_leaf(n.op) || ph.load_of(id) >= 0) continue;
    s << "  const " << T << " " << value_name(id) << " = " << expr(id, element) << ";\n";
  }
  auto out = [&](NodeId id) {
    const Node& n = p.graph.node(id);
    if (plan_.kind[static_cast<size_t>(id)] == ValueKind::Element) return value_name(id);
    if (n.op == Op::Const) return literal(n.value, element);
    return "u[" + std::to_string(plan_.derived_slot.at(id)) + "]";
  };
  for (size_t k = 0; k < ph.reductions.size(); ++k) {
    const Node& r = p.graph.node(ph.reductions[k]);
    std::string x = value_name(r.in[0]);
    if (r.op == Op::SumSquares) s << "  acc[" << k << "] += (double)" << x << " * (double)" << x << ";\n";
    else if (r.op == Op::Sum) s << "  acc[" << k << "] += (double)" << x << ";\n";
    else if (r.op == Op::MaxAbs) s << "  acc[" << k << "] = of_max(acc[" << k << "], fabs((double)" << x << "));\n";
    else s << "  if (!" << fill(d_.is_finite, x) << ") acc[" << k << "] = 1.0;\n";
  }
  for (size_t k = 0; k < ph.writes_states.size(); ++k)
    s << "  v[" << 2 + ph.writes_states[k] << "] = " << out(ph.write_values[k]) << ";\n";
  if (ph.writes_param) s << "  v[0] = " << out(p.param_out) << ";\n";
  if (ph.kind == ElementPhase::Kind::Reduce || !ph.reads_param) s << "  (void)v; (void)u; (void)acc;\n";
  else s << "  (void)u; (void)acc;\n";
  s << "}\n";
  return s.str();
}

std::string CPrinter::scalar_function(size_t phase) const {
  const ElementPhase& ph = plan_.phases.at(phase);
  const Program& p = plan_.program;
  const Graph& g = p.graph;
  bool final_phase = ph.kind == ElementPhase::Kind::Update;
  int limit = final_phase ? ph.level : ph.level - 1;
  std::ostringstream s;
  s << "\n// phase " << phase << ": uniform values of one parameter group, float64 math\n";
  // The uniform states' arguments only where the chain has some: other chains' sources (and
  // their compile keys, the golden files) are unchanged.
  const bool ustates = !p.uniform_states.empty();
  s << "OF_FN void of_phase" << phase << "_scalars(const double* hyper, double steps, const double* globals, "
    << "const double* reductions, double* derived, double* skip, double* steps_out"
    << (ustates ? ", const double* ustate, double* ustate_out" : "") << ") {\n";
  for (size_t i = 0; i < g.size(); ++i) {
    if (plan_.kind[i] != ValueKind::Uniform || plan_.level[i] > limit) continue;
    const Node& n = g.node(static_cast<NodeId>(i));
    if (n.op == Op::Const) continue;
    std::string rhs;
    switch (n.op) {
      case Op::Hyper: rhs = "hyper[" + std::to_string(n.index) + "]"; break;
      case Op::Step: rhs = "steps + 1.0"; break;
      case Op::Global: rhs = "globals[" + std::to_string(n.index) + "]"; break;
      case Op::UniformState: rhs = "ustate[" + std::to_string(n.index) + "]"; break;
      case Op::SumSquares:
      case Op::Sum:
      case Op::MaxAbs:
      case Op::AnyNonFinite: {
        rhs = "reductions[" + std::to_string(plan_.reduction_area_slot[plan_.reduction_index(static_cast<NodeId>(i))]) + "]";
        break;
      }
      default: rhs = expr(static_cast<NodeId>(i), false);
    }
    s << "  const double " << value_name(static_cast<NodeId>(i)) << " = " << rhs << ";\n";
  }
  for (size_t d = 0; d < plan_.derived.size(); ++d)
    if (plan_.level[static_cast<size_t>(plan_.derived[d])] <= limit)
      s << "  derived[" << d << "] = " << value_name(plan_.derived[d]) << ";\n";
  if (final_phase) {
    if (p.skip != kNoNode) {
      const Node& sk = g.node(p.skip);
      std::string cond = sk.op == Op::Const ? literal(sk.value, false) : value_name(p.skip);
      s << "  const bool skip_step = " << cond << " != 0.0;\n";
    } else {
      s << "  const bool skip_step = false;\n";
    }
    s << "  *skip = skip_step ? 1.0 : 0.0;\n  if (!skip_step) *steps_out = steps + 1.0;\n";
    if (ustates) {  // after every read of ustate above: ustate_out may be the same row
      s << "  if (!skip_step) {  // the uniform states, committed as the step count\n";
      for (size_t u = 0; u < p.uniform_state_out.size(); ++u) {
        const Node& n = g.node(p.uniform_state_out[u]);
        s << "    ustate_out[" << u << "] = "
          << (n.op == Op::Const ? literal(n.value, false) : value_name(p.uniform_state_out[u])) << ";\n";
      }
      s << "  }\n";
    }
  }
  s << "  (void)hyper; (void)steps; (void)globals; (void)reductions; (void)derived; (void)skip; (void)steps_out;"
    << (ustates ? " (void)ustate; (void)ustate_out;" : "") << "\n}\n";
  return s.str();
}

std::string CPrinter::tensor_function(size_t phase, bool f64) const { return tensor_values_function(phase, false, f64); }

std::string CPrinter::per_matrix_tensor_function(size_t phase, bool f64) const {
  return plan_.matrix() ? tensor_values_function(phase, true, f64) : std::string();
}

std::string CPrinter::tensor_values_function(size_t phase, bool per_matrix_only, bool f64) const {
  const Program& p = plan_.program;
  const Graph& g = p.graph;
  const int limit = plan_.value_level_limit(plan_.phases.at(phase));
  // The values to print: every tensor value of the levels this phase reads, or (per_matrix_only)
  // the outputs that read a sum of row or column values, maybe through others, and their inputs.
  std::vector<bool> print(g.size(), !per_matrix_only);
  if (per_matrix_only) {
    std::vector<bool> per_matrix(g.size(), false);
    for (NodeId id : plan_.tensor_value_nodes(limit, true)) per_matrix[static_cast<size_t>(id)] = true;
    std::vector<NodeId> stack;
    for (NodeId t : plan_.tensor_derived)
      if (per_matrix[static_cast<size_t>(t)]) stack.push_back(t);
    if (stack.empty()) return std::string();
    while (!stack.empty()) {
      const NodeId id = stack.back();
      stack.pop_back();
      if (plan_.kind[static_cast<size_t>(id)] != ValueKind::Tensor || print[static_cast<size_t>(id)]) continue;
      print[static_cast<size_t>(id)] = true;
      const Node& n = g.node(id);
      if (!op_is_reduction(n.op))
        for (int k = 0; k < op_arity(n.op); ++k) stack.push_back(n.in[k]);
    }
  }
  std::ostringstream s;
  s << "\n// phase " << phase << ": values of one tensor (from its group's derived row and its reductions), float64 math"
    << (per_matrix_only ? "; only those that read the matrix's sums" : "") << "\n";
  // A matrix plan's tensor values may read the tensor's shape (Op::Shape: numel, rows of a matrix,
  // cols, is_matrix) and the sums of row and column values of the matrix they are for (`sums`).
  const bool shaped = plan_.matrix();
  s << "OF_FN void of_phase" << phase << (per_matrix_only ? "_tensor_matrix" : "_tensor") << f64_suffix(f64)
    << "(const double* derived, const double* reductions, " << (shaped ? "const double* sums, const double* shape, " : "")
    << (f64 ? "double" : "float") << "* u) {\n";
  std::set<NodeId> declared;
  for (size_t i = 0; i < g.size(); ++i) {
    if (plan_.kind[i] != ValueKind::Tensor || plan_.level[i] > limit || !print[i]) continue;
    const Node& n = g.node(static_cast<NodeId>(i));
    if (op_is_reduction(n.op)) {
      s << "  const double " << value_name(static_cast<NodeId>(i)) << " = "
        << (plan_.is_value_reduction(static_cast<NodeId>(i)) ? "sums[" : "reductions[")
        << plan_.reduction_area_slot[plan_.reduction_index(static_cast<NodeId>(i))] << "];\n";
      continue;
    }
    if (n.op == Op::Shape) {
      s << "  const double " << value_name(static_cast<NodeId>(i)) << " = shape[" << n.index << "];\n";
      continue;
    }
    for (int k = 0; k < op_arity(n.op); ++k) {
      NodeId x = n.in[k];
      if (plan_.kind[static_cast<size_t>(x)] != ValueKind::Uniform || g.node(x).op == Op::Const) continue;
      if (declared.insert(x).second)
        s << "  const double " << value_name(x) << " = derived[" << plan_.derived_slot.at(x) << "];\n";
    }
    s << "  const double " << value_name(static_cast<NodeId>(i)) << " = " << expr(static_cast<NodeId>(i), false) << ";\n";
  }
  const size_t d = plan_.derived.size();
  for (size_t k = 0; k < plan_.tensor_derived.size(); ++k)
    if (plan_.level[static_cast<size_t>(plan_.tensor_derived[k])] <= limit && print[static_cast<size_t>(plan_.tensor_derived[k])])
      s << "  u[" << k << "] = " << (f64 ? "" : "(float)") << value_name(plan_.tensor_derived[k]) << ";  // u[" << d + k
        << "] of the element function\n";
  s << "  (void)derived; (void)reductions; (void)u;" << (shaped ? " (void)sums; (void)shape;" : "") << "\n}\n";
  return s.str();
}

std::string CPrinter::line_function(size_t phase, bool cols, bool f64) const {
  const Program& p = plan_.program;
  const Graph& g = p.graph;
  const int limit = plan_.value_level_limit(plan_.phases.at(phase));
  const ValueKind kind = cols ? ValueKind::Col : ValueKind::Row;
  const char* what = cols ? "column" : "row";
  const std::vector<NodeId>& outs = cols ? plan_.col_derived : plan_.row_derived;
  const std::string T = f64 ? "double" : "float";
  std::ostringstream s;
  s << "\n// phase " << phase << ": the values of one " << what << " (the Values step), " << (f64 ? "float64" : "float32")
    << " math: st[s] the "
    << what << " state s, red[k] its " << what << " reduction k, out[k] its " << what << " value k; sums[k] gathers the\n"
    << "// per-tensor sums (tensor_reductions slot k) of " << what << " values\n";
  s << "OF_FN void of_phase" << phase << "_" << (cols ? "cols" : "rows") << f64_suffix(f64) << "(const " << T
    << "* u, const " << T << "* st, const double* red, " << T << "* out, double* sums) {\n";
  std::set<NodeId> declared;
  auto declare_input = [&](NodeId x) {
    const ValueKind k = plan_.kind[static_cast<size_t>(x)];
    if (k == kind || g.node(x).op == Op::Const || !declared.insert(x).second) return;
    s << "  const " << T << " " << value_name(x) << " = u[" << plan_.derived_slot.at(x) << "];\n";
  };
  for (size_t i = 0; i < g.size(); ++i) {
    const NodeId id = static_cast<NodeId>(i);
    const Node& n = g.node(id);
    if (plan_.kind[i] != kind || plan_.level[i] > limit) continue;
    if (n.op == Op::State) {
      s << "  const " << T << " " << value_name(id) << " = st[" << n.index << "];\n";
    } else if (op_is_reduction(n.op)) {
      s << "  const " << T << " " << value_name(id) << " = (" << T << ")red[" << plan_.reduction_area_slot[plan_.reduction_index(id)] << "];\n";
    } else {
      for (int k = 0; k < op_arity(n.op); ++k) declare_input(n.in[k]);
      s << "  const " << T << " " << value_name(id) << " = " << expr(id, !f64) << ";\n";
    }
  }
  for (size_t k = 0; k < outs.size(); ++k)
    if (plan_.level[static_cast<size_t>(outs[k])] <= limit) {
      const Node& n = g.node(outs[k]);
      s << "  out[" << k << "] = " << (n.op == Op::Const ? literal(n.value, !f64) : value_name(outs[k])) << ";\n";
    }
  for (NodeId r : plan_.reductions) {
    const Node& n = g.node(r);
    if (!plan_.is_value_reduction(r) || plan_.kind[static_cast<size_t>(n.in[0])] != kind ||
        plan_.level[static_cast<size_t>(r)] > limit)
      continue;
    const std::string x = "(double)" + value_name(n.in[0]);
    const int slot = plan_.reduction_area_slot[plan_.reduction_index(r)];
    if (n.op == Op::SumSquares) s << "  sums[" << slot << "] += " << x << " * " << x << ";\n";
    else if (n.op == Op::Sum) s << "  sums[" << slot << "] += " << x << ";\n";
    else if (n.op == Op::MaxAbs) s << "  sums[" << slot << "] = of_max(sums[" << slot << "], fabs(" << x << "));\n";
    else s << "  if (!" << fill(d_.is_finite, value_name(n.in[0])) << ") sums[" << slot << "] = 1.0;\n";
  }
  s << "  (void)u; (void)st; (void)red; (void)out; (void)sums;\n}\n";
  return s.str();
}

std::string CPrinter::common_source(bool f64) const {
  std::string s = prelude();
  for (size_t i = 0; i < plan_.phases.size(); ++i) {
    s += scalar_function(i);
    for (bool d : {false, true}) {
      if (d && !f64) continue;
      if (plan_.layout.tensor_values > 0) s += tensor_function(i, d);
      if (plan_.matrix()) s += line_function(i, false, d) + line_function(i, true, d);
      s += element_function(i, d);
    }
  }
  return s;
}

const Dialect& cpu_dialect() {
  static const Dialect d{"cpu", "static inline", "std::isfinite(%s)", "1.0f / sqrtf(%s)",
                         "#include <cmath>\n#include <cstring>\n#include <cstdint>\nusing std::memcpy;\n"};
  return d;
}

const Dialect& cuda_dialect() {
  // NVRTC provides memcpy as a device builtin: the CUDA dialect needs no includes.
  static const Dialect d{"cuda", "__device__ __forceinline__", "isfinite(%s)", "rsqrtf(%s)", ""};
  return d;
}

}  // namespace optfuse
