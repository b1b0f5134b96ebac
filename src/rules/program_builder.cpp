// Rule declarations, the builder rules write their math with, and build_program, which runs a
// chain's rules in order into one graph.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "optfuse/error.h"
#include "optfuse/rule.h"
#include "rules/suggest.h"

namespace optfuse {

bool Range::contains(double v) const {
  if (std::isnan(v)) return false;
  if (lo_open ? !(v > lo) : !(v >= lo)) return false;
  if (hi_open ? !(v < hi) : !(v <= hi)) return false;
  return true;
}

static std::string fmt_num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

std::string Range::describe() const {
  bool no_lo = lo <= -1e308, no_hi = hi >= 1e308;
  if (no_lo && no_hi) return "any number";
  if (no_hi) return std::string(lo_open ? "> " : ">= ") + fmt_num(lo);
  if (no_lo) return std::string(hi_open ? "< " : "<= ") + fmt_num(hi);
  return std::string("in ") + (lo_open ? "(" : "[") + fmt_num(lo) + ", " + fmt_num(hi) +
         (hi_open ? ")" : "]");
}

static void check_name(const std::string& what, const std::string& n) {
  bool ok = !n.empty();
  for (char ch : n) ok = ok && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_');
  if (!ok || std::isdigit(static_cast<unsigned char>(n[0])))
    throw Error(what + " name '" + n + "' must be an identifier (letters, digits, _)");
}

namespace {
thread_local bool t_hyper_range_checks = true;
}

bool hyper_range_checks() { return t_hyper_range_checks; }
void set_hyper_range_checks(bool on) { t_hyper_range_checks = on; }

Rule& Rule::hyper(const std::string& name, double value, Range range) {
  check_name("hyperparameter", name);
  for (auto& h : hypers_)
    if (h.name == name) throw Error("rule " + name_ + ": hyperparameter '" + name + "' declared twice");
  if (t_hyper_range_checks && !range.contains(value))
    throw Error("rule " + name_ + ": " + name + "=" + fmt_num(value) + " is invalid: must be " +
                range.describe());
  hypers_.push_back({name, value, range});
  return *this;
}

Rule& Rule::state(const std::string& name, double init) {
  check_name("state", name);
  for (auto& s : states_)
    if (s.name == name) throw Error("rule " + name_ + ": state '" + name + "' declared twice");
  states_.push_back({name, init});
  return *this;
}

Rule& Rule::row_state(const std::string& name, double init) {
  state(name, init);
  states_.back().shape = StateShape::Rows;
  return *this;
}

Rule& Rule::col_state(const std::string& name, double init) {
  state(name, init);
  states_.back().shape = StateShape::Cols;
  return *this;
}

const char* state_shape_name(StateShape s) {
  switch (s) {
    case StateShape::Full: return "full";
    case StateShape::Rows: return "rows";
    case StateShape::Cols: return "columns";
  }
  return "?";
}

Rule& Rule::state_from_param(const std::string& name) {
  state(name, 0);
  states_.back().from_param = true;
  return *this;
}

Rule& Rule::uniform_state(const std::string& name, double init) {
  check_name("uniform state", name);
  for (auto& s : uniform_states_)
    if (s.name == name) throw Error("rule " + name_ + ": uniform state '" + name + "' declared twice");
  uniform_states_.push_back({name, init});
  return *this;
}

Rule& Rule::update(UpdateFn fn) {
  if (has_matrix_) throw Error("rule " + name_ + ": a matrix rule has no update function");
  fn_ = std::move(fn);
  return *this;
}

Rule& Rule::note(const std::string& text) {
  notes_ = notes_.empty() ? text : notes_ + ", " + text;
  return *this;
}

std::string NewtonSchulzOptions::problem() const {
  if (steps < 0 || steps >= 100)
    return "Newton-Schulz steps must be in [0, 100) (torch.optim.Muon's limit), got " + std::to_string(steps);
  for (double c : coefficients)
    if (!std::isfinite(c)) return "Newton-Schulz coefficients must be finite";
  if (!(eps >= 0) || !std::isfinite(eps)) return "Newton-Schulz eps must be finite and >= 0";
  return "";
}

Rule& Rule::matrix_phase(const NewtonSchulzOptions& options) {
  if (fn_) throw Error("rule " + name_ + ": a matrix rule has no update function");
  if (const std::string why = options.problem(); !why.empty()) throw Error("rule " + name_ + ": " + why);
  has_matrix_ = true;
  matrix_ = options;
  return *this;
}

std::string Rule::signature() const {
  std::ostringstream s;
  s << name_ << "(";
  for (size_t i = 0; i < hypers_.size(); ++i)
    s << (i ? ", " : "") << hypers_[i].name << "=" << fmt_num(hypers_[i].value);
  if (!notes_.empty()) s << (hypers_.empty() ? "" : ", ") << notes_;
  if (has_matrix_)
    s << (hypers_.empty() && notes_.empty() ? "" : ", ") << "a=" << fmt_num(matrix_.coefficients[0])
      << ", b=" << fmt_num(matrix_.coefficients[1]) << ", c=" << fmt_num(matrix_.coefficients[2])
      << ", steps=" << matrix_.steps << ", eps=" << fmt_num(matrix_.eps);
  s << ")";
  return s.str();
}

Chain chain(std::initializer_list<Chain> parts) {
  Chain out;
  for (const Chain& c : parts) out.insert(out.end(), c.begin(), c.end());
  return out;
}

const char* global_name(int32_t slot) {
  switch (slot) {
    case kGradScale: return "grad_scale";
    case kFoundInf: return "found_inf";
    default: return "?";
  }
}

std::vector<int> Program::find_hypers(const std::string& name) const {
  std::vector<int> out;
  for (size_t i = 0; i < hypers.size(); ++i)
    if (hypers[i].name == name || hypers[i].qualified == name) out.push_back(static_cast<int>(i));
  if (out.empty()) {
    std::vector<std::string> known, short_names;
    for (auto& h : hypers) {
      known.push_back(h.name);
      known.push_back(h.qualified);
      if (std::find(short_names.begin(), short_names.end(), h.name) == short_names.end())
        short_names.push_back(h.name);
    }
    throw Error("unknown hyperparameter '" + name + "'" + suggestion(name, known) +
                " (this chain has: " + join_names(short_names, 1) + ")");
  }
  return out;
}

int Program::find_uniform_state(const std::string& name) const {
  std::vector<std::string> known;
  for (size_t i = 0; i < uniform_states.size(); ++i) {
    if (uniform_states[i].name == name || uniform_states[i].qualified == name) return static_cast<int>(i);
    known.push_back(uniform_states[i].qualified);
  }
  throw Error("unknown uniform state '" + name + "'" + suggestion(name, known) +
              (known.empty() ? " (this chain has none)" : " (this chain has: " + join_names(known, 1) + ")"));
}

RuleBuilder::RuleBuilder(Program& p, const Rule& r, int first_state, int first_hyper, int first_uniform_state,
                         Expr param, Expr incoming, Expr* param_base)
    : p_(p), param_(param), param_base_(param_base), rule_(r), first_state_(first_state), first_hyper_(first_hyper),
      first_uniform_state_(first_uniform_state), incoming_(incoming) {}

static Expr leaf(Graph& g, Op op, int32_t index = -1) {
  Node n;
  n.op = op;
  n.index = index;
  return {&g, g.add(n)};
}

Expr RuleBuilder::param() { return param_; }
Expr RuleBuilder::update() { return incoming_; }
Expr RuleBuilder::step() { return leaf(p_.graph, Op::Step); }
Expr RuleBuilder::shape(ShapeItem item) { return tensor_shape(p_.graph, item); }
Expr RuleBuilder::global(GlobalSlot slot) { return leaf(p_.graph, Op::Global, slot); }
Expr RuleBuilder::constant(double v) { return optfuse::constant(p_.graph, v); }

static int find_declared(const std::string& rule, const char* what, const std::string& name,
                         const std::vector<std::string>& declared) {
  for (size_t i = 0; i < declared.size(); ++i)
    if (declared[i] == name) return static_cast<int>(i);
  throw Error("rule " + rule + " reads " + what + " '" + name + "' that it did not declare" +
              suggestion(name, declared) +
              (declared.empty() ? " (it declares none)" : " (declared: " + join_names(declared, 1) + ")"));
}

Expr RuleBuilder::state(const std::string& name) {
  std::vector<std::string> names;
  for (auto& s : rule_.states()) names.push_back(s.name);
  int i = find_declared(rule_.name(), "state", name, names);
  return leaf(p_.graph, Op::State, first_state_ + i);
}

void RuleBuilder::set_state(const std::string& name, Expr value) {
  std::vector<std::string> names;
  for (auto& s : rule_.states()) names.push_back(s.name);
  int i = find_declared(rule_.name(), "state", name, names);
  if (!value.valid() || value.graph != &p_.graph)
    throw Error("rule " + rule_.name() + ": set_state('" + name + "') got an expression of another graph");
  p_.state_out[static_cast<size_t>(first_state_ + i)] = value.id;
  p_.names.emplace(value.id, name + "_new");
}

Expr RuleBuilder::hyper(const std::string& name) {
  std::vector<std::string> names;
  for (auto& h : rule_.hypers()) names.push_back(h.name);
  int i = find_declared(rule_.name(), "hyperparameter", name, names);
  Expr e = leaf(p_.graph, Op::Hyper, first_hyper_ + i);
  p_.names.emplace(e.id, name);
  return e;
}

Expr RuleBuilder::uniform_state(const std::string& name) {
  std::vector<std::string> names;
  for (auto& s : rule_.uniform_states()) names.push_back(s.name);
  int i = find_declared(rule_.name(), "uniform state", name, names);
  Expr e = leaf(p_.graph, Op::UniformState, first_uniform_state_ + i);
  p_.names.emplace(e.id, name);
  return e;
}

static bool is_element_value(const Graph& g, NodeId id);

void RuleBuilder::set_uniform_state(const std::string& name, Expr value) {
  std::vector<std::string> names;
  for (auto& s : rule_.uniform_states()) names.push_back(s.name);
  int i = find_declared(rule_.name(), "uniform state", name, names);
  if (!value.valid() || value.graph != &p_.graph)
    throw Error("rule " + rule_.name() + ": set_uniform_state('" + name + "') got an expression of another graph");
  if (is_element_value(p_.graph, value.id))
    throw Error("rule " + rule_.name() + ": uniform state '" + name + "' needs a uniform value (one per group), "
                "not a per-element one; reduce it first, e.g. with global_sum_of_squares()");
  p_.uniform_state_out[static_cast<size_t>(first_uniform_state_ + i)] = value.id;
  p_.names.emplace(value.id, name + "_new");
}

// Whether a value differs per element: it reads a param, grad or state without a reduction between.
static bool is_element_value(const Graph& g, NodeId id) {
  std::vector<NodeId> stack{id};
  std::vector<bool> seen(g.size(), false);
  while (!stack.empty()) {
    NodeId n = stack.back();
    stack.pop_back();
    if (seen[static_cast<size_t>(n)]) continue;
    seen[static_cast<size_t>(n)] = true;
    const Node& x = g.node(n);
    if (x.op == Op::Param || x.op == Op::Grad || x.op == Op::State) return true;
    if (op_is_reduction(x.op)) continue;
    for (int k = 0; k < op_arity(x.op); ++k) stack.push_back(x.in[k]);
  }
  return false;
}

void RuleBuilder::skip_step_if(Expr cond) {
  if (!cond.valid() || cond.graph != &p_.graph)
    throw Error("rule " + rule_.name() + ": skip_step_if got an expression of another graph");
  // Checked here, not only by the planner, so that the error names the rule (build_program's contract).
  if (is_element_value(p_.graph, cond.id))
    throw Error("rule " + rule_.name() + ": skip_step_if needs a uniform condition (one value for the whole "
                "step), not a per-element one; reduce it first, e.g. with any_nonfinite()");
  p_.skip = p_.skip == kNoNode ? cond.id : (Expr{&p_.graph, p_.skip} || cond).id;
}

void RuleBuilder::scale_param(Expr factor) {
  if (!factor.valid() || factor.graph != &p_.graph)
    throw Error("rule " + rule_.name() + ": scale_param got an expression of another graph");
  set_param_base(*param_base_ * factor);
}

Expr RuleBuilder::param_base() { return *param_base_; }

void RuleBuilder::set_param_base(Expr base) {
  if (!base.valid() || base.graph != &p_.graph)
    throw Error("rule " + rule_.name() + ": set_param_base got an expression of another graph");
  *param_base_ = base;
  p_.names.emplace(param_base_->id, "param_decayed");
}

Expr RuleBuilder::name(Expr e, const std::string& n) {
  check_name("value", n);
  if (e.valid()) p_.names.emplace(e.id, n);
  return e;
}

const char* master_weights_name(MasterWeights m) {
  switch (m) {
    case MasterWeights::none: return "none";
    case MasterWeights::copy: return "copy";
    case MasterWeights::remainders: return "remainders";
  }
  return "?";
}

namespace {

// The precision states, after the rules' states, and what the rules see as the parameter.
struct PrecisionSlots {
  int master = -1, remainder = -1, compensation = -1;
};

PrecisionSlots add_precision_states(Program& p, const Precision& prec) {
  if (prec.kahan && prec.master != MasterWeights::none)
    throw Error("kahan compensates the rounding of parameters stored without a master copy; with master weights "
                "(" + std::string(master_weights_name(prec.master)) + ") nothing is rounded away: choose one");
  if (prec.kahan && !dtype_is_low_precision_float(prec.kahan_dtype))
    throw Error(std::string("kahan compensation is for float16 or bfloat16 parameters, not ") + dtype_name(prec.kahan_dtype));
  PrecisionSlots s;
  auto add = [&](const char* rule, const char* name, bool fixed, DType dtype, bool from_param) {
    ProgramState st{rule, name, std::string(rule) + "." + name, 0.0, from_param, fixed, dtype};
    p.states.push_back(st);
    return static_cast<int>(p.states.size()) - 1;
  };
  if (prec.master == MasterWeights::copy) s.master = add("master_weights", "master_param", true, DType::f32, true);
  if (prec.master == MasterWeights::remainders) s.remainder = add("master_weights", "param_remainder", true, DType::i16, false);
  if (prec.kahan) s.compensation = add("kahan", "kahan_comp", false, DType::f32, false);
  return s;
}

}  // namespace

Program build_program(const Chain& chain, const Precision& precision) {
  if (chain.empty()) throw Error("a chain needs at least one rule");
  for (const Rule& r : chain)
    if (r.matrix_phase())
      throw Error("rule " + r.name() + " is a matrix phase (Newton-Schulz of whole matrices), which no element-wise "
                  "program holds: run the chain with optfuse::MatrixChainOptimizer (C++, optfuse/matrix_chain.h; "
                  "in Python, optfuse.torch.Muon)");
  Program p;
  p.precision = precision;
  std::map<std::string, int> uses;
  for (const Rule& r : chain) {
    int n = ++uses[r.name()];
    std::string prefix = n == 1 ? r.name() : r.name() + "#" + std::to_string(n);
    for (auto& s : r.states()) {
      p.states.push_back({r.name(), s.name, prefix + "." + s.name, s.init, s.from_param});
      p.states.back().shape = s.shape;
    }
    for (auto& h : r.hypers()) p.hypers.push_back({r.name(), h.name, prefix + "." + h.name, h.value, h.range});
    for (auto& u : r.uniform_states()) p.uniform_states.push_back({r.name(), u.name, prefix + "." + u.name, u.init});
    p.chain_text += (p.chain_text.empty() ? "" : ", ") + r.signature();
  }
  p.chain_text = "chain(" + p.chain_text + ")";
  const PrecisionSlots slots = add_precision_states(p, precision);
  if (precision.master != MasterWeights::none) p.chain_text += " with master weights (" + std::string(master_weights_name(precision.master)) + ")";
  if (precision.kahan) p.chain_text += " with kahan compensation (" + std::string(dtype_name(precision.kahan_dtype)) + ")";
  // State outputs default to "unchanged": the slot's own leaf.
  for (size_t i = 0; i < p.states.size(); ++i) {
    p.state_out.push_back(leaf(p.graph, Op::State, static_cast<int32_t>(i)).id);
    p.names.emplace(p.state_out.back(), p.states[i].name);
  }
  for (size_t i = 0; i < p.uniform_states.size(); ++i) {
    p.uniform_state_out.push_back(leaf(p.graph, Op::UniformState, static_cast<int32_t>(i)).id);
    p.names.emplace(p.uniform_state_out.back(), p.uniform_states[i].name);
  }
  Expr stored = leaf(p.graph, Op::Param);  // the parameter as stored
  p.names.emplace(stored.id, "param");
  // What the rules see as the parameter: the stored one, or the float32 master.
  Expr param = stored;
  if (slots.master >= 0) param = Expr{&p.graph, p.state_out[static_cast<size_t>(slots.master)]};
  if (slots.remainder >= 0) {
    param = master_from_remainder(stored, Expr{&p.graph, p.state_out[static_cast<size_t>(slots.remainder)]});
    p.names.emplace(param.id, "master");
  }
  Expr param_base = param;  // what the final update is added to (scale_param may decay it)
  Expr incoming = leaf(p.graph, Op::Grad);
  p.names.emplace(incoming.id, "grad");
  int first_state = 0, first_hyper = 0, first_uniform_state = 0;
  for (const Rule& r : chain) {
    if (!r.update_fn()) throw Error("rule " + r.name() + " has no update function");
    RuleBuilder b(p, r, first_state, first_hyper, first_uniform_state, param, incoming, &param_base);
    Expr out = r.update_fn()(b);
    if (!out.valid() || out.graph != &p.graph)
      throw Error("rule " + r.name() + " returned no update expression");
    p.names.emplace(out.id, "upd_" + r.name());
    incoming = out;
    first_state += static_cast<int>(r.states().size());
    first_hyper += static_cast<int>(r.hypers().size());
    first_uniform_state += static_cast<int>(r.uniform_states().size());
  }
  Expr pnew = param_base + incoming;
  p.names.emplace(pnew.id, "param_new");
  p.param_out = pnew.id;
  if (slots.master >= 0) p.state_out[static_cast<size_t>(slots.master)] = pnew.id;  // stored rounded to nearest
  if (slots.remainder >= 0) {
    Expr rem = remainder_of_master(pnew), high = param_of_master(pnew);
    p.names.emplace(rem.id, "remainder_new");
    p.names.emplace(high.id, "param_stored");
    p.state_out[static_cast<size_t>(slots.remainder)] = rem.id;
    p.param_out = high.id;
  }
  if (slots.compensation >= 0) {
    // Kahan summation of the parameter: y = the update plus what the last store rounded away,
    // stored = param + y rounded to the parameter's dtype, compensation = y - (stored - param).
    Expr comp{&p.graph, p.state_out[static_cast<size_t>(slots.compensation)]};
    Expr y = (pnew - stored) + comp;
    Expr sum = stored + y;
    Expr rounded = precision.kahan_dtype == DType::bf16 ? round_to_bf16(sum) : round_to_f16(sum);
    Expr comp_new = y - (rounded - stored);
    p.names.emplace(y.id, "kahan_update");
    p.names.emplace(rounded.id, "param_stored");
    p.names.emplace(comp_new.id, "compensation_new");
    p.state_out[static_cast<size_t>(slots.compensation)] = comp_new.id;
    p.param_out = rounded.id;
  }
  return p;
}

}  // namespace optfuse
