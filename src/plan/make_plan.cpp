// Classifies nodes (uniform / element, level), checks the program is plannable, and cuts it into
// phases: one reduce pass per reduction level, then one update pass. See plan.h for the model.
#include <algorithm>
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

void classify(Plan& plan) {
  const Graph& g = plan.program.graph;
  plan.kind.assign(g.size(), ValueKind::Uniform);
  plan.level.assign(g.size(), 0);
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(static_cast<NodeId>(i));
    if (n.op == Op::Param || n.op == Op::Grad || n.op == Op::State) {
      plan.kind[i] = ValueKind::Element;
      continue;
    }
    int lvl = 0;
    bool element = false;
    for (int k = 0; k < op_arity(n.op); ++k) {
      size_t in = static_cast<size_t>(n.in[k]);
      lvl = std::max(lvl, plan.level[in]);
      element = element || plan.kind[in] == ValueKind::Element;
    }
    if (op_is_reduction(n.op)) {
      if (!element) throw Error(std::string("IR: ") + op_name(n.op) + " of a uniform value (it must reduce element values)");
      plan.kind[i] = ValueKind::Uniform;
      plan.level[i] = lvl + 1;
    } else {
      plan.kind[i] = element ? ValueKind::Element : ValueKind::Uniform;
      plan.level[i] = lvl;
    }
  }
  if (plan.program.skip != kNoNode && plan.kind[static_cast<size_t>(plan.program.skip)] == ValueKind::Element)
    throw Error("skip_step_if needs a uniform condition (one value for the whole step), not a per-element one; "
                "reduce it first, e.g. with any_nonfinite()");
}

// Element nodes reachable from `roots` without crossing into uniform values, in topological order.
std::vector<NodeId> element_closure(const Plan& plan, const std::vector<NodeId>& roots) {
  const Graph& g = plan.program.graph;
  std::vector<bool> seen(g.size(), false);
  std::vector<NodeId> stack;
  for (NodeId r : roots)
    if (plan.kind[static_cast<size_t>(r)] == ValueKind::Element) stack.push_back(r);
  while (!stack.empty()) {
    NodeId id = stack.back();
    stack.pop_back();
    if (seen[static_cast<size_t>(id)]) continue;
    seen[static_cast<size_t>(id)] = true;
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
  for (NodeId id : ph.nodes) {
    const Node& n = g.node(id);
    if (n.op == Op::Param) ph.reads_param = true;
    if (n.op == Op::Grad) ph.reads_grad = true;
    if (n.op == Op::State) states.insert(n.index);
  }
  ph.reads_states.assign(states.begin(), states.end());
}

}  // namespace

Plan make_plan(Program program) {
  Plan plan;
  plan.program = run_passes(std::move(program), &plan.pass_log);
  classify(plan);
  const Program& p = plan.program;
  const Graph& g = p.graph;

  for (size_t i = 0; i < g.size(); ++i)
    if (op_is_reduction(g.node(static_cast<NodeId>(i)).op)) plan.reductions.push_back(static_cast<NodeId>(i));

  int max_level = 0;
  auto lvl = [&](NodeId id) { return id == kNoNode ? 0 : plan.level[static_cast<size_t>(id)]; };
  max_level = std::max(max_level, lvl(p.param_out));
  for (NodeId s : p.state_out) max_level = std::max(max_level, lvl(s));
  max_level = std::max(max_level, lvl(p.skip));
  for (NodeId r : plan.reductions) max_level = std::max(max_level, lvl(r));

  for (int L = 1; L <= max_level; ++L) {
    ElementPhase ph;
    ph.kind = ElementPhase::Kind::Reduce;
    ph.level = L;
    std::vector<NodeId> inputs;
    for (NodeId r : plan.reductions)
      if (plan.level[static_cast<size_t>(r)] == L) {
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
  fill_access(plan, up);
  up.reads_param = true;  // param_new = param + update: the parameter is always read and written
  up.writes_param = true;
  for (size_t s = 0; s < p.state_out.size(); ++s) {
    const Node& n = g.node(p.state_out[s]);
    bool unchanged = n.op == Op::State && n.index == static_cast<int32_t>(s);
    if (!unchanged) up.writes_states.push_back(static_cast<int>(s));
  }
  plan.phases.push_back(up);

  // Uniform values element code reads become derived slots.
  for (const ElementPhase& ph : plan.phases)
    for (NodeId id : ph.nodes) {
      const Node& n = g.node(id);
      for (int k = 0; k < op_arity(n.op); ++k) {
        NodeId in = n.in[k];
        if (plan.kind[static_cast<size_t>(in)] != ValueKind::Uniform) continue;
        if (g.node(in).op == Op::Const) continue;  // printed inline as a literal
        if (plan.derived_slot.emplace(in, static_cast<int>(plan.derived.size())).second) plan.derived.push_back(in);
      }
    }
  // Element outputs that are themselves uniform (e.g. a state set to a constant) are broadcast.
  for (NodeId root : roots)
    if (plan.kind[static_cast<size_t>(root)] == ValueKind::Uniform && g.node(root).op != Op::Const &&
        plan.derived_slot.emplace(root, static_cast<int>(plan.derived.size())).second)
      plan.derived.push_back(root);

  plan.layout.hypers_per_group = static_cast<int>(p.hypers.size());
  plan.layout.derived_per_group = static_cast<int>(plan.derived.size());
  plan.layout.reductions = static_cast<int>(plan.reductions.size());
  return plan;
}

Plan make_plan(const Chain& chain) { return make_plan(build_program(chain)); }

std::string Plan::describe(DType storage) const {
  std::ostringstream s;
  size_t bytes = dtype_size(storage);
  const Program& p = program;
  int total_r = 0, total_w = 0;
  s << "plan for " << p.chain_text << "\n";
  s << "  storage " << dtype_name(storage) << "; " << phases.size() << " pass(es) over memory\n";
  for (size_t i = 0; i < phases.size(); ++i) {
    const ElementPhase& ph = phases[i];
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
      for (NodeId r : ph.reductions) s << " " << op_name(program.graph.node(r).op);
      s << ")";
    }
    s << "\n    bytes per element: " << ph.reads() * bytes << " read + " << ph.writes() * bytes
      << " written = " << (ph.reads() + ph.writes()) * bytes << "\n";
    total_r += ph.reads();
    total_w += ph.writes();
  }
  s << "  total bytes per element: " << (total_r + total_w) * bytes << "\n";
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
    for (int k = 0; k < op_arity(n.op); ++k) s << (k ? ", %" : " %") << n.in[k];
    std::string note;
    if (kinds) note += (*kinds)[i] == ValueKind::Element ? "element" : "uniform";
    auto it = p.names.find(static_cast<NodeId>(i));
    if (it != p.names.end()) note += (note.empty() ? "" : " ") + it->second;
    if (static_cast<NodeId>(i) == p.param_out) note += " -> param";
    for (size_t st = 0; st < p.state_out.size(); ++st)
      if (p.state_out[st] == static_cast<NodeId>(i) && !(n.op == Op::State && n.index == static_cast<int32_t>(st)))
        note += " -> " + p.states[st].qualified;
    if (static_cast<NodeId>(i) == p.skip) note += " -> skip";
    if (!note.empty()) s << "   ; " << note;
    s << "\n";
  }
  return s.str();
}

}  // namespace optfuse
