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

Rule& Rule::hyper(const std::string& name, double value, Range range) {
  check_name("hyperparameter", name);
  for (auto& h : hypers_)
    if (h.name == name) throw Error("rule " + name_ + ": hyperparameter '" + name + "' declared twice");
  if (!range.contains(value))
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

Rule& Rule::update(UpdateFn fn) {
  fn_ = std::move(fn);
  return *this;
}

Rule& Rule::note(const std::string& text) {
  notes_ = notes_.empty() ? text : notes_ + ", " + text;
  return *this;
}

std::string Rule::signature() const {
  std::ostringstream s;
  s << name_ << "(";
  for (size_t i = 0; i < hypers_.size(); ++i)
    s << (i ? ", " : "") << hypers_[i].name << "=" << fmt_num(hypers_[i].value);
  if (!notes_.empty()) s << (hypers_.empty() ? "" : ", ") << notes_;
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

RuleBuilder::RuleBuilder(Program& p, const Rule& r, int first_state, int first_hyper, Expr incoming,
                         Expr* param_base)
    : p_(p), param_base_(param_base), rule_(r), first_state_(first_state), first_hyper_(first_hyper),
      incoming_(incoming) {}

static Expr leaf(Graph& g, Op op, int32_t index = -1) {
  Node n;
  n.op = op;
  n.index = index;
  return {&g, g.add(n)};
}

Expr RuleBuilder::param() { return leaf(p_.graph, Op::Param); }
Expr RuleBuilder::update() { return incoming_; }
Expr RuleBuilder::step() { return leaf(p_.graph, Op::Step); }
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

Program build_program(const Chain& chain) {
  if (chain.empty()) throw Error("a chain needs at least one rule");
  Program p;
  std::map<std::string, int> uses;
  std::vector<std::string> qual_prefix;
  for (const Rule& r : chain) {
    int n = ++uses[r.name()];
    std::string prefix = n == 1 ? r.name() : r.name() + "#" + std::to_string(n);
    for (auto& s : r.states()) p.states.push_back({r.name(), s.name, prefix + "." + s.name, s.init});
    for (auto& h : r.hypers()) p.hypers.push_back({r.name(), h.name, prefix + "." + h.name, h.value, h.range});
    p.chain_text += (p.chain_text.empty() ? "" : ", ") + r.signature();
  }
  p.chain_text = "chain(" + p.chain_text + ")";
  // State outputs default to "unchanged": the slot's own leaf.
  for (size_t i = 0; i < p.states.size(); ++i) {
    p.state_out.push_back(leaf(p.graph, Op::State, static_cast<int32_t>(i)).id);
    p.names.emplace(p.state_out.back(), p.states[i].name);
  }
  Expr param = leaf(p.graph, Op::Param);
  p.names.emplace(param.id, "param");
  Expr param_base = param;  // what the final update is added to (scale_param may decay it)
  Expr incoming = leaf(p.graph, Op::Grad);
  p.names.emplace(incoming.id, "grad");
  int first_state = 0, first_hyper = 0;
  for (const Rule& r : chain) {
    if (!r.update_fn()) throw Error("rule " + r.name() + " has no update function");
    RuleBuilder b(p, r, first_state, first_hyper, incoming, &param_base);
    Expr out = r.update_fn()(b);
    if (!out.valid() || out.graph != &p.graph)
      throw Error("rule " + r.name() + " returned no update expression");
    p.names.emplace(out.id, "upd_" + r.name());
    incoming = out;
    first_state += static_cast<int>(r.states().size());
    first_hyper += static_cast<int>(r.hypers().size());
  }
  Expr pnew = param_base + incoming;
  p.param_out = pnew.id;
  p.names.emplace(pnew.id, "param_new");
  return p;
}

}  // namespace optfuse
