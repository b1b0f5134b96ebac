// Classifies nodes (uniform / element, level), checks the program is plannable, and cuts it into
// phases: one reduce pass per reduction level, then one update pass. See plan.h for the model.
#include <algorithm>
#include <climits>
#include <set>
#include <sstream>

#include "optfuse/error.h"
#include "optfuse/plan.h"
#include "passes/pass_pipeline.h"

namespace optfuse {

int ElementPhase::reads() const {
  return static_cast<int>(reads_param) + static_cast<int>(reads_grad) +
         static_cast<int>(reads_states.size());
}
int ElementPhase::writes() const {
  return static_cast<int>(writes_param) + static_cast<int>(writes_states.size());
}

namespace {

// The kind of a value computed from values of kinds a and b: the wider one, where a row value and
// a column value make an element value (one per (row, column)).
ValueKind widest(ValueKind a, ValueKind b) {
  if (a == b) return a;
  if ((a == ValueKind::Row && b == ValueKind::Col) || (a == ValueKind::Col && b == ValueKind::Row)) return ValueKind::Element;
  return static_cast<uint8_t>(a) > static_cast<uint8_t>(b) ? a : b;
}

// "uniform", "per-tensor", "per-row"...: for messages.
std::string kind_phrase(ValueKind k) {
  return k == ValueKind::Uniform ? "uniform" : std::string("per-") + value_kind_name(k);
}

ValueKind state_kind(StateShape s) {
  return s == StateShape::Rows ? ValueKind::Row : s == StateShape::Cols ? ValueKind::Col : ValueKind::Element;
}

// The kind (and level) of a reduction of a value of kind `in`.
ValueKind reduction_kind(const Node& n, ValueKind in) {
  const Scope scope = reduction_scope(n);
  if (in == ValueKind::Element) {
    switch (scope) {
      case Scope::Global: return ValueKind::Uniform;
      case Scope::Tensor: return ValueKind::Tensor;
      case Scope::Row: return ValueKind::Row;
      case Scope::Col: return ValueKind::Col;
    }
  }
  if ((in == ValueKind::Row || in == ValueKind::Col) && scope == Scope::Tensor) return ValueKind::Tensor;
  if (in == ValueKind::Uniform || in == ValueKind::Tensor)
    throw Error(std::string("IR: ") + op_name(n.op) + " of a " + kind_phrase(in) + " value (it must reduce element values)");
  throw Error(std::string("IR: ") + op_name(n.op) + " over a " + scope_name(scope) + " of a " + kind_phrase(in) +
              " value (reductions take element values, or row or column values summed over their tensor)");
}

void classify(Plan& plan) {
  const Graph& g = plan.program.graph;
  plan.kind.assign(g.size(), ValueKind::Uniform);
  plan.level.assign(g.size(), 0);
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(static_cast<NodeId>(i));
    if (n.op == Op::Param || n.op == Op::Grad) {
      plan.kind[i] = ValueKind::Element;
      continue;
    }
    if (n.op == Op::State) {
      plan.kind[i] = state_kind(plan.program.states.at(static_cast<size_t>(n.index)).shape);
      continue;
    }
    if (n.op == Op::Shape) {
      plan.kind[i] = ValueKind::Tensor;
      continue;
    }
    int lvl = 0;
    ValueKind kind = ValueKind::Uniform;
    for (int k = 0; k < op_arity(n.op); ++k) {
      size_t in = static_cast<size_t>(n.in[k]);
      lvl = std::max(lvl, plan.level[in]);
      kind = widest(kind, plan.kind[in]);
    }
    if (op_is_reduction(n.op)) {
      plan.kind[i] = reduction_kind(n, kind);
      // A sum of row or column values is taken with them (the Values step): no pass, no new level.
      plan.level[i] = kind == ValueKind::Element ? lvl + 1 : lvl;
    } else {
      plan.kind[i] = kind;
      plan.level[i] = lvl;
    }
  }
  for (size_t u = 0; u < plan.program.uniform_state_out.size(); ++u) {
    ValueKind k = plan.kind[static_cast<size_t>(plan.program.uniform_state_out[u])];
    if (k != ValueKind::Uniform)
      throw Error("uniform state " + plan.program.uniform_states[u].qualified + " needs a uniform new value (one per "
                  "group), not a " + kind_phrase(k) + " one");
  }
  if (plan.program.skip != kNoNode) {
    ValueKind k = plan.kind[static_cast<size_t>(plan.program.skip)];
    if (k == ValueKind::Element)
      throw Error("skip_step_if needs a uniform condition (one value for the whole step), not a per-element one; "
                  "reduce it first, e.g. with any_nonfinite()");
    if (k != ValueKind::Uniform)
      throw Error(std::string("skip_step_if needs a uniform condition (one value for the whole step), not a ") +
                  kind_phrase(k) + " one; use a global reduction, e.g. any_nonfinite()");
  }
  const Program& p = plan.program;
  for (size_t s = 0; s < p.states.size(); ++s) {
    const StateShape shape = p.states[s].shape;
    if (shape == StateShape::Full) continue;
    const ValueKind k = plan.kind[static_cast<size_t>(p.state_out[s])];
    const bool constant = p.graph.node(p.state_out[s]).op == Op::Const;
    if (!constant && k != (shape == StateShape::Rows ? ValueKind::Row : ValueKind::Col))
      throw Error("state " + p.states[s].qualified + " holds one value per " +
                  (shape == StateShape::Rows ? "row" : "column") + "; its new value is " + kind_phrase(k) +
                  " (it needs a " + (shape == StateShape::Rows ? "per-row" : "per-column") + " value)");
    if (p.states[s].init_from_param)
      throw Error("state " + p.states[s].qualified + " holds one value per " + state_shape_name(shape) +
                  " and cannot start as a copy of the parameter");
  }
  // Row and column values are evaluated before the per-tensor sums of row and column values of
  // their level are taken (the Values step): they cannot read them.
  std::vector<bool> after_value_sum(g.size(), false);
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(static_cast<NodeId>(i));
    const bool value_sum = op_is_reduction(n.op) && (plan.kind[static_cast<size_t>(n.in[0])] == ValueKind::Row ||
                                                      plan.kind[static_cast<size_t>(n.in[0])] == ValueKind::Col);
    bool dep = value_sum;
    for (int k = 0; k < op_arity(n.op) && !op_is_reduction(n.op); ++k) dep = dep || after_value_sum[static_cast<size_t>(n.in[k])];
    after_value_sum[i] = dep;
    if (dep && (plan.kind[i] == ValueKind::Row || plan.kind[i] == ValueKind::Col))
      throw Error("IR: a row or column value reads a per-tensor sum of row or column values (%" + std::to_string(i) +
                  "); only element and per-tensor math may use such a sum");
  }
}

// Element nodes reachable from `roots` without crossing into uniform values, in topological order.
// Nodes of `loads` are leaves (read from a role, not computed).
std::vector<NodeId> element_closure(const Plan& plan, const std::vector<NodeId>& roots,
                                    const std::vector<std::pair<NodeId, int>>& loads = {}) {
  const Graph& g = plan.program.graph;
  std::vector<bool> seen(g.size(), false), leaf(g.size(), false);
  for (const auto& [node, state] : loads) leaf[static_cast<size_t>(node)] = true;
  std::vector<NodeId> stack;
  for (NodeId r : roots)
    if (plan.kind[static_cast<size_t>(r)] == ValueKind::Element) stack.push_back(r);
  while (!stack.empty()) {
    NodeId id = stack.back();
    stack.pop_back();
    if (seen[static_cast<size_t>(id)]) continue;
    seen[static_cast<size_t>(id)] = true;
    if (leaf[static_cast<size_t>(id)]) continue;
    const Node& n = g.node(id);
    for (int k = 0; k < op_arity(n.op); ++k)
      if (plan.kind[static_cast<size_t>(n.in[k])] == ValueKind::Element) stack.push_back(n.in[k]);
  }
  std::vector<NodeId> out;
  for (size_t i = 0; i < g.size(); ++i)
    if (seen[i]) out.push_back(static_cast<NodeId>(i));
  return out;
}

void fill_access(const Plan& plan, ElementPhase& ph) {
  const Graph& g = plan.program.graph;
  std::set<int> states;
  ph.reads_param = ph.reads_grad = false;
  for (NodeId id : ph.nodes) {
    const Node& n = g.node(id);
    const int loaded = ph.load_of(id);
    if (loaded >= 0) states.insert(loaded);
    else if (n.op == Op::Param) ph.reads_param = true;
    else if (n.op == Op::Grad) ph.reads_grad = true;
    else if (n.op == Op::State) states.insert(n.index);
  }
  ph.reads_states.assign(states.begin(), states.end());
}

// The reduce phases for the current levels, then the update phase.
void build_phases(Plan& plan) {
  const Program& p = plan.program;
  const Graph& g = p.graph;
  plan.phases.clear();
  int max_level = 0;
  auto lvl = [&](NodeId id) { return id == kNoNode ? 0 : plan.level[static_cast<size_t>(id)]; };
  max_level = std::max(max_level, lvl(p.param_out));
  for (NodeId s : p.state_out) max_level = std::max(max_level, lvl(s));
  max_level = std::max(max_level, lvl(p.skip));
  for (NodeId u : p.uniform_state_out) max_level = std::max(max_level, lvl(u));
  for (NodeId r : plan.reductions) max_level = std::max(max_level, lvl(r));

  for (int L = 1; L <= max_level; ++L) {
    ElementPhase ph;
    ph.kind = ElementPhase::Kind::Reduce;
    ph.level = L;
    std::vector<NodeId> inputs;
    for (NodeId r : plan.reductions)
      if (plan.level[static_cast<size_t>(r)] == L && !plan.is_value_reduction(r)) {
        ph.reductions.push_back(r);
        inputs.push_back(g.node(r).in[0]);
      }
    if (ph.reductions.empty()) continue;
    ph.nodes = element_closure(plan, inputs);
    fill_access(plan, ph);
    plan.phases.push_back(ph);
  }

  ElementPhase up;
  up.kind = ElementPhase::Kind::Update;
  up.level = max_level;
  std::vector<NodeId> roots{p.param_out};
  for (NodeId s : p.state_out) roots.push_back(s);
  up.nodes = element_closure(plan, roots);
  fill_access(plan, up);  // reads the parameter where param_new depends on it (not beside a master copy)
  up.writes_param = true;
  for (size_t s = 0; s < p.state_out.size(); ++s) {
    const Node& n = g.node(p.state_out[s]);
    bool unchanged = n.op == Op::State && n.index == static_cast<int32_t>(s);
    // Rows and Cols states are written by the Commit step, from the value tables.
    if (!unchanged && p.states[s].shape == StateShape::Full) {
      up.writes_states.push_back(static_cast<int>(s));
      up.write_values.push_back(p.state_out[s]);
    }
  }
  plan.phases.push_back(up);
}

// Moves the writes of states into the last reduce pass where that saves traffic. A state qualifies
// when its new value is an element value that needs none of that pass's reductions (its level is
// below the pass's), it is a rule's state stored in the storage dtype (not a precision state), and
// the update pass, reading the new value back from the state's role, no longer needs the old one.
// The move is made when the update pass then reads and writes fewer roles than the reduce pass
// gains: LAMB's reduce pass (||p||, ||update||) writes m and v, and its update pass reads m, v and
// p instead of p, g, m and v and writes p alone (28 + 16 -> 24 + 16 bytes per element in float32).
// The update pass reads the stored value: in float32 the very bits it would have computed. A tensor
// whose states are stored in 16 bits runs the replaced phases instead (Plan::recomputing): reading a
// rounded state back would change its math (a float16 v that underflows to 0 would divide m by eps).
// Where the step may be skipped, the skip must be decided from values of lower levels than the pass
// (GradScaler's found_inf): the pass then writes `skip ? old : new`, so a skipped step leaves the
// states as they were. Not for matrix plans.
void write_states_ahead(Plan& plan) {
  Program& p = plan.program;
  if (plan.phases.size() < 2 || plan.reads_shape) return;
  for (ValueKind k : plan.kind)
    if (k == ValueKind::Row || k == ValueKind::Col) return;
  ElementPhase& reduce = plan.phases[plan.phases.size() - 2];
  ElementPhase& update = plan.phases.back();
  if (reduce.kind != ElementPhase::Kind::Reduce) return;
  // (a skip folded to the constant 0 never skips: the states need no select)
  const bool may_skip = p.skip != kNoNode && !(p.graph.node(p.skip).op == Op::Const && p.graph.node(p.skip).value == 0.0);
  if (p.skip != kNoNode && plan.level[static_cast<size_t>(p.skip)] >= reduce.level) return;
  std::vector<int> ahead;
  for (int s : update.writes_states) {
    const NodeId out = p.state_out[static_cast<size_t>(s)];
    if (!p.states[static_cast<size_t>(s)].fixed_dtype && plan.kind[static_cast<size_t>(out)] == ValueKind::Element &&
        plan.level[static_cast<size_t>(out)] < reduce.level)
      ahead.push_back(s);
  }
  // The update pass with those states loaded; a state whose old value it still reads stays there.
  ElementPhase later;
  for (bool changed = true; changed && !ahead.empty();) {
    later = ElementPhase{};
    later.kind = ElementPhase::Kind::Update;
    later.level = update.level;
    later.writes_param = true;
    std::vector<NodeId> roots{p.param_out};
    for (size_t k = 0; k < update.writes_states.size(); ++k) {
      const int s = update.writes_states[k];
      if (std::find(ahead.begin(), ahead.end(), s) != ahead.end()) {
        later.loads.push_back({p.state_out[static_cast<size_t>(s)], s});
      } else {
        later.writes_states.push_back(s);
        later.write_values.push_back(update.write_values[k]);
        roots.push_back(update.write_values[k]);
      }
    }
    later.nodes = element_closure(plan, roots, later.loads);
    changed = false;
    for (NodeId id : later.nodes) {
      const Node& n = p.graph.node(id);
      if (n.op != Op::State || later.load_of(id) >= 0) continue;
      auto it = std::find(ahead.begin(), ahead.end(), n.index);
      if (it != ahead.end()) {
        ahead.erase(it);
        changed = true;
      }
    }
  }
  if (ahead.empty()) return;
  // The reduce pass writing them (its closure grows by their math). The graph is append-only: it is
  // put back as it was if the move does not pay.
  const Program saved = p;
  const size_t nodes_before = p.graph.size();
  ElementPhase earlier = reduce;
  std::vector<NodeId> roots;
  for (NodeId r : reduce.reductions) roots.push_back(p.graph.node(r).in[0]);
  for (int s : ahead) {
    NodeId value = p.state_out[static_cast<size_t>(s)];
    if (may_skip) {
      Node old_value;
      old_value.op = Op::State;
      old_value.index = s;
      Node keep;
      keep.op = Op::Select;
      keep.in = {p.skip, p.graph.add(old_value), value};
      value = p.graph.add(keep);
      plan.kind.resize(p.graph.size(), ValueKind::Element);  // (new nodes are element values)
      plan.level.resize(p.graph.size(), 0);
      plan.level[static_cast<size_t>(value)] =
          std::max(plan.level[static_cast<size_t>(p.skip)], plan.level[static_cast<size_t>(p.state_out[static_cast<size_t>(s)])]);
    }
    earlier.writes_states.push_back(s);
    earlier.write_values.push_back(value);
    roots.push_back(value);
  }
  earlier.nodes = element_closure(plan, roots);
  fill_access(plan, later);
  fill_access(plan, earlier);
  const int before = reduce.reads() + reduce.writes() + update.reads() + update.writes();
  const int after = earlier.reads() + earlier.writes() + later.reads() + later.writes();
  if (after >= before) {
    p = saved;
    plan.kind.resize(nodes_before);
    plan.level.resize(nodes_before);
    return;
  }
  plan.recomputing = {reduce, update};
  reduce = earlier;
  update = later;
}

// Moves a reduction to a later reduce pass when nothing consumes it sooner (no pass before that one
// reads a value derived from it) and that pass already reads every role the reduction's input
// reads: the later pass computes it for free and the earlier one reads less (or disappears).
// LAMB's ||param|| joins ||update||. Levels above a moved reduction are recomputed.
bool delay_reductions(Plan& plan) {
  const Program& p = plan.program;
  const Graph& g = p.graph;
  const int last = static_cast<int>(plan.phases.size()) - 1;
  // earliest[n]: the first phase that reads non-element value n, directly or through other non-element values
  std::vector<int> earliest(g.size(), INT_MAX);
  std::vector<std::pair<NodeId, int>> stack;
  auto mark = [&](NodeId root, int phase) {
    stack.push_back({root, phase});
    while (!stack.empty()) {
      auto [n, ph] = stack.back();
      stack.pop_back();
      if (plan.kind[static_cast<size_t>(n)] == ValueKind::Element || earliest[static_cast<size_t>(n)] <= ph) continue;
      earliest[static_cast<size_t>(n)] = ph;
      const Node& x = g.node(n);
      if (op_is_reduction(x.op)) continue;  // its input is an element value, computed in its own pass
      for (int k = 0; k < op_arity(x.op); ++k) stack.push_back({x.in[k], ph});
    }
  };
  for (int i = 0; i <= last; ++i)
    for (NodeId id : plan.phases[static_cast<size_t>(i)].nodes) {
      const Node& n = g.node(id);
      for (int k = 0; k < op_arity(n.op); ++k) mark(n.in[k], i);
    }
  mark(p.param_out, last);
  for (NodeId s : p.state_out) mark(s, last);
  if (p.skip != kNoNode) mark(p.skip, last);
  for (NodeId u : p.uniform_state_out) mark(u, last);

  std::vector<int> forced(g.size(), 0);
  bool moved = false;
  for (NodeId r : plan.reductions) {
    if (plan.is_value_reduction(r)) continue;  // taken by the Values step, in no pass
    int cur = -1, target = -1;
    for (int i = 0; i <= last; ++i) {
      const ElementPhase& ph = plan.phases[static_cast<size_t>(i)];
      if (ph.kind != ElementPhase::Kind::Reduce) continue;
      if (std::find(ph.reductions.begin(), ph.reductions.end(), r) != ph.reductions.end()) cur = i;
      if (i < earliest[static_cast<size_t>(r)]) target = i;
    }
    if (target <= cur) continue;
    const ElementPhase& later = plan.phases[static_cast<size_t>(target)];
    ElementPhase mine;
    mine.nodes = element_closure(plan, {g.node(r).in[0]});
    fill_access(plan, mine);
    bool covered = (!mine.reads_param || later.reads_param) && (!mine.reads_grad || later.reads_grad);
    for (int st : mine.reads_states)
      covered = covered && std::find(later.reads_states.begin(), later.reads_states.end(), st) != later.reads_states.end();
    if (!covered) continue;
    forced[static_cast<size_t>(r)] = later.level;
    moved = true;
  }
  if (!moved) return false;
  for (size_t i = 0; i < g.size(); ++i) {  // levels again, with the moved reductions at their new level
    const Node& n = g.node(static_cast<NodeId>(i));
    if (op_arity(n.op) == 0) continue;
    int lvl = 0;
    for (int k = 0; k < op_arity(n.op); ++k) lvl = std::max(lvl, plan.level[static_cast<size_t>(n.in[k])]);
    if (op_is_reduction(n.op) && !plan.is_value_reduction(static_cast<NodeId>(i))) lvl = std::max(lvl + 1, forced[i]);
    plan.level[i] = lvl;
  }
  return true;
}

// Uniform values element or tensor code reads become derived slots; tensor values element code
// reads become tensor slots (u = [derived | tensor]).
void assign_value_slots(Plan& plan) {
  const Program& p = plan.program;
  const Graph& g = p.graph;
  std::set<NodeId> seen;
  auto need = [&](NodeId in) {
    ValueKind k = plan.kind[static_cast<size_t>(in)];
    if (k == ValueKind::Element || g.node(in).op == Op::Const) return;  // constants are printed inline
    if (!seen.insert(in).second) return;
    (k == ValueKind::Uniform  ? plan.derived
     : k == ValueKind::Tensor ? plan.tensor_derived
     : k == ValueKind::Row    ? plan.row_derived
                              : plan.col_derived)
        .push_back(in);
  };
  for (const std::vector<ElementPhase>* phases : {&plan.phases, &plan.recomputing})
    for (const ElementPhase& ph : *phases)
      for (NodeId id : ph.nodes) {
        const Node& n = g.node(id);
        for (int k = 0; k < op_arity(n.op); ++k) need(n.in[k]);
      }
  // Element outputs that are themselves uniform or per tensor (e.g. a state set to a constant) are broadcast.
  need(p.param_out);
  for (NodeId s : p.state_out) need(s);
  // Tensor values are computed per chunk from the group's derived row: their uniform inputs are
  // derived. Row and column values (Values step) read uniform and tensor values from u likewise.
  for (size_t i = 0; i < g.size(); ++i) {
    const ValueKind kind = plan.kind[i];
    if (kind != ValueKind::Tensor && kind != ValueKind::Row && kind != ValueKind::Col) continue;
    const Node& n = g.node(static_cast<NodeId>(i));
    if (op_is_reduction(n.op)) continue;
    for (int k = 0; k < op_arity(n.op); ++k) {
      const ValueKind in = plan.kind[static_cast<size_t>(n.in[k])];
      if (in == ValueKind::Uniform || (kind != ValueKind::Tensor && in == ValueKind::Tensor)) need(n.in[k]);
    }
  }
  // A Rows / Cols state's new value is kept in the value table until the Commit step.
  for (size_t s = 0; s < p.states.size(); ++s)
    if (p.states[s].shape != StateShape::Full && g.node(p.state_out[s]).op != Op::Const) need(p.state_out[s]);
  int next = 0;
  for (const std::vector<NodeId>* area : {&plan.derived, &plan.tensor_derived, &plan.row_derived, &plan.col_derived})
    for (NodeId id : *area) plan.derived_slot[id] = next++;
}

}  // namespace

Plan make_plan(Program program) {
  Plan plan;
  plan.program = run_passes(std::move(program), &plan.pass_log);
  classify(plan);
  const Graph& g = plan.program.graph;
  int slots[4] = {0, 0, 0, 0};  // per Scope: global area, tensor, row, column tables
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(static_cast<NodeId>(i));
    if (n.op == Op::Shape) plan.reads_shape = true;
    if (!op_is_reduction(n.op)) continue;
    plan.reductions.push_back(static_cast<NodeId>(i));
    plan.reduction_area_slot.push_back(slots[static_cast<int>(reduction_scope(n))]++);
  }
  build_phases(plan);
  if (delay_reductions(plan)) build_phases(plan);
  write_states_ahead(plan);
  assign_value_slots(plan);
  plan.layout.hypers_per_group = static_cast<int>(plan.program.hypers.size());
  plan.layout.derived_per_group = static_cast<int>(plan.derived.size());
  plan.layout.uniform_states_per_group = static_cast<int>(plan.program.uniform_states.size());
  plan.layout.reductions = slots[static_cast<int>(Scope::Global)];
  plan.layout.tensor_reductions = slots[static_cast<int>(Scope::Tensor)];
  plan.layout.tensor_values = static_cast<int>(plan.tensor_derived.size());
  plan.layout.row_reductions = slots[static_cast<int>(Scope::Row)];
  plan.layout.col_reductions = slots[static_cast<int>(Scope::Col)];
  plan.layout.row_values = static_cast<int>(plan.row_derived.size());
  plan.layout.col_values = static_cast<int>(plan.col_derived.size());
  plan.schedule = make_schedule(plan);
  return plan;
}

Plan make_plan(const Chain& chain, const Precision& precision) { return make_plan(build_program(chain, precision)); }

bool Plan::runs_states_ahead(const std::vector<DType>& state_dtypes) const {
  if (recomputing.empty()) return true;
  for (int s : phases[phases.size() - 2].writes_states)
    if (state_dtypes.at(static_cast<size_t>(s)) != DType::f32 && state_dtypes.at(static_cast<size_t>(s)) != DType::f64) return false;
  return true;
}

const ElementPhase& Plan::phase_for(size_t i, bool states_ahead) const {
  if (states_ahead || !has_recomputing_form(i)) return phases.at(i);
  return recomputing.at(i + 2 - phases.size());
}

int ElementPhase::load_of(NodeId id) const {
  for (const auto& [node, state] : loads)
    if (node == id) return state;
  return -1;
}

const char* value_kind_name(ValueKind k) {
  switch (k) {
    case ValueKind::Uniform: return "uniform";
    case ValueKind::Tensor: return "tensor";
    case ValueKind::Row: return "row";
    case ValueKind::Col: return "column";
    case ValueKind::Element: return "element";
  }
  return "?";
}

bool Plan::is_value_reduction(NodeId reduction) const {
  const ValueKind in = kind.at(static_cast<size_t>(program.graph.node(reduction).in[0]));
  return in == ValueKind::Row || in == ValueKind::Col;
}

std::vector<NodeId> Plan::tensor_value_nodes(int limit, bool per_matrix_only) const {
  const Graph& g = program.graph;
  std::vector<bool> per_matrix(g.size(), false);  // reads a sum of row or column values, maybe through others
  std::vector<NodeId> out;
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(static_cast<NodeId>(i));
    if (op_is_reduction(n.op)) {
      per_matrix[i] = kind[i] == ValueKind::Tensor && is_value_reduction(static_cast<NodeId>(i));
    } else {
      for (int k = 0; k < op_arity(n.op); ++k) per_matrix[i] = per_matrix[i] || per_matrix[static_cast<size_t>(n.in[k])];
    }
    if (kind[i] == ValueKind::Tensor && level[i] <= limit && (!per_matrix_only || per_matrix[i]))
      out.push_back(static_cast<NodeId>(i));
  }
  return out;
}

size_t Plan::line_value_index(NodeId node) const {
  // u = [derived | tensor | row | column]: a row value's slot less the first row slot, a column's
  // less the first column slot.
  const size_t rows_first = derived.size() + tensor_derived.size(), cols_first = rows_first + row_derived.size();
  const size_t slot = static_cast<size_t>(derived_slot.at(node));
  return slot - (kind.at(static_cast<size_t>(node)) == ValueKind::Col ? cols_first : rows_first);
}

size_t Plan::reduction_index(NodeId node) const {
  auto it = std::find(reductions.begin(), reductions.end(), node);
  if (it == reductions.end()) throw Error("plan: node %" + std::to_string(node) + " is not a reduction");
  return static_cast<size_t>(it - reductions.begin());
}

std::string Plan::describe(DType storage) const {
  std::ostringstream s;
  size_t bytes = dtype_size(storage);
  const Program& p = program;
  int total_r = 0, total_w = 0;
  s << "plan for " << p.chain_text << "\n";
  // States stored in `storage` (but fixed-dtype ones): 16-bit ones written ahead run the recomputing forms.
  const bool ahead = storage == DType::f32 || storage == DType::f64;
  s << "  storage " << dtype_name(storage) << "; " << phases.size() << " pass(es) over memory\n";
  if (!recomputing.empty())
    s << "  states written ahead by phase " << phases.size() - 1 << " and read back by the update pass"
      << (ahead ? "" : " in float32 storage only; in this storage the last two phases recompute them") << "\n";
  for (size_t i = 0; i < phases.size(); ++i) {
    const ElementPhase& ph = phase_for(i, ahead);
    s << "  phase " << i + 1 << ": " << (ph.kind == ElementPhase::Kind::Reduce ? "reduce" : "update");
    s << " (level " << ph.level << ")\n    reads:";
    if (ph.reads_param) s << " param";
    if (ph.reads_grad) s << " grad";
    for (int st : ph.reads_states) s << " " << p.states[static_cast<size_t>(st)].qualified;
    s << "\n    writes:";
    if (ph.writes_param) s << " param";
    for (int st : ph.writes_states) s << " " << p.states[static_cast<size_t>(st)].qualified;
    if (ph.kind == ElementPhase::Kind::Reduce) {
      s << " (partial sums of";
      for (NodeId r : ph.reductions) {
        const Node& n = program.graph.node(r);
        s << " " << op_name(n.op) << (reduction_scope(n) == Scope::Global ? "" : std::string("/") + scope_name(reduction_scope(n)));
      }
      s << ")";
    }
    // Each role at its size: the storage dtype, or a precision state's fixed dtype (a float32
    // master, an int16 remainder).
    auto state_bytes = [&](int st) {
      const ProgramState& ps = p.states[static_cast<size_t>(st)];
      return static_cast<int>(ps.fixed_dtype ? dtype_size(ps.dtype) : bytes);
    };
    int r = (ph.reads_param ? 1 : 0) * static_cast<int>(bytes) + (ph.reads_grad ? 1 : 0) * static_cast<int>(bytes);
    for (int st : ph.reads_states) r += state_bytes(st);
    int w = (ph.writes_param ? 1 : 0) * static_cast<int>(bytes);
    for (int st : ph.writes_states) w += state_bytes(st);
    s << "\n    bytes per element: " << r << " read + " << w << " written = " << r + w << "\n";
    total_r += r;
    total_w += w;
  }
  s << "  total bytes per element: " << total_r + total_w << "\n";
  s << "  schedule:\n";
  std::istringstream steps(describe_schedule(*this));
  for (std::string line; std::getline(steps, line);) s << "    " << line << "\n";
  s << "  scalars per group: " << layout.hypers_per_group << " hyperparameters, step, skip flag, "
    << layout.derived_per_group << " derived values";
  if (!derived.empty()) {
    s << " (";
    for (size_t i = 0; i < derived.size(); ++i) {
      auto it = p.names.find(derived[i]);
      s << (i ? ", " : "") << (it != p.names.end() ? it->second : "%" + std::to_string(derived[i]));
    }
    s << ")";
  }
  s << "\n";
  if (!p.uniform_states.empty()) {
    s << "  uniform states per group (float64, kept across steps, committed by the final scalar phase where the step "
         "is not skipped):";
    for (size_t u = 0; u < p.uniform_states.size(); ++u) {
      const NodeId out = p.uniform_state_out[u];
      auto it = p.names.find(out);
      const Node& n = p.graph.node(out);
      bool unchanged = n.op == Op::UniformState && n.index == static_cast<int32_t>(u);
      s << (u ? "," : "") << " " << p.uniform_states[u].qualified << " (init " << p.uniform_states[u].init << ") <- "
        << (unchanged ? "unchanged" : it != p.names.end() ? it->second : "%" + std::to_string(out));
    }
    s << "\n";
  }
  if (layout.tensor_reductions > 0) {
    s << "  scalars per tensor: " << layout.tensor_reductions << " reductions, " << tensor_derived.size()
      << " tensor values (";
    for (size_t i = 0; i < tensor_derived.size(); ++i) {
      auto it = p.names.find(tensor_derived[i]);
      s << (i ? ", " : "") << (it != p.names.end() ? it->second : "%" + std::to_string(tensor_derived[i]));
    }
    s << "), computed per chunk\n";
  }
  if (matrix()) {
    auto names = [&](const std::vector<NodeId>& ids) {
      std::string out;
      for (size_t i = 0; i < ids.size(); ++i) {
        auto it = p.names.find(ids[i]);
        out += (i ? ", " : "") + (it != p.names.end() ? it->second : "%" + std::to_string(ids[i]));
      }
      return out;
    };
    s << "  per row of each tensor's matrix view: " << layout.row_reductions << " reductions, " << layout.row_values
      << " row values (" << names(row_derived) << ")\n";
    s << "  per column: " << layout.col_reductions << " reductions (partials per chunk), " << layout.col_values
      << " column values (" << names(col_derived) << ")\n";
  }
  return s.str();
}

std::string print_ir(const Program& p, const std::vector<ValueKind>* kinds) {
  std::ostringstream s;
  for (size_t i = 0; i < p.graph.size(); ++i) {
    const Node& n = p.graph.node(static_cast<NodeId>(i));
    s << "  %" << i << " = " << op_name(n.op);
    if (n.op == Op::Const) s << " " << n.value;
    if (n.op == Op::State) s << " " << p.states.at(static_cast<size_t>(n.index)).qualified;
    if (n.op == Op::Hyper) s << " " << p.hypers.at(static_cast<size_t>(n.index)).qualified;
    if (n.op == Op::Global) s << " " << global_name(n.index);
    if (n.op == Op::UniformState) s << " " << p.uniform_states.at(static_cast<size_t>(n.index)).qualified;
    if (n.op == Op::Shape) s << " " << (n.index == 0 ? "numel" : n.index == 1 ? "rows" : n.index == 2 ? "cols" : "is_matrix");
    if (op_is_reduction(n.op) && reduction_scope(n) != Scope::Global) s << " [" << scope_name(reduction_scope(n)) << "]";
    for (int k = 0; k < op_arity(n.op); ++k) s << (k ? ", %" : " %") << n.in[k];
    std::string note;
    if (kinds) note += value_kind_name((*kinds)[i]);
    auto it = p.names.find(static_cast<NodeId>(i));
    if (it != p.names.end()) note += (note.empty() ? "" : " ") + it->second;
    if (static_cast<NodeId>(i) == p.param_out) note += " -> param";
    for (size_t st = 0; st < p.state_out.size(); ++st)
      if (p.state_out[st] == static_cast<NodeId>(i) && !(n.op == Op::State && n.index == static_cast<int32_t>(st)))
        note += " -> " + p.states[st].qualified;
    if (static_cast<NodeId>(i) == p.skip) note += " -> skip";
    for (size_t u = 0; u < p.uniform_state_out.size(); ++u)
      if (p.uniform_state_out[u] == static_cast<NodeId>(i) && !(n.op == Op::UniformState && n.index == static_cast<int32_t>(u)))
        note += " -> " + p.uniform_states[u].qualified;
    if (!note.empty()) s << "   ; " << note;
    s << "\n";
  }
  return s.str();
}

}  // namespace optfuse
