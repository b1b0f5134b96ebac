#include "eval/interpreter.h"

#include <cmath>

#include "ir/low_precision.h"
#include "optfuse/error.h"

namespace optfuse {

void set_globals(double* table, const StepInputs& in) {
  table[kGradScale] = in.grad_scale ? static_cast<double>(*in.grad_scale) : 1.0;
  table[kFoundInf] = in.found_inf ? static_cast<double>(*in.found_inf) : 0.0;
}

void combine_partials(const Plan& plan, size_t phase, const std::function<const double*(size_t)>& row,
                      const std::vector<ChunkRange>& spans, int64_t columns, double* table,
                      std::vector<double>& tensor_reductions) {
  const Graph& g = plan.program.graph;
  const ScalarLayout& L = plan.layout;
  for (NodeId node : plan.phases.at(phase).reductions) {
    const size_t r = plan.reduction_index(node);
    const bool any = g.node(node).op == Op::AnyNonFinite;
    auto add = [any](double acc, double v) { return any ? (acc != 0 || v != 0 ? 1.0 : 0.0) : acc + v; };
    const int slot = plan.reduction_area_slot[r];
    const double* partials = row(r);
    if (plan.scope_of(r) == Scope::Global) {
      double acc = 0;
      for (int64_t c = 0; c < columns; ++c) acc = add(acc, partials[c]);
      table[L.reductions_offset() + slot] = acc;
    } else {  // per tensor: the tensor's chunks, in chunk order
      const size_t rt = static_cast<size_t>(L.tensor_reductions);
      for (size_t t = 0; t < spans.size(); ++t) {
        double acc = 0;
        for (uint32_t c = 0; c < spans[t].count; ++c) acc = add(acc, partials[spans[t].first + c]);
        tensor_reductions[t * rt + static_cast<size_t>(slot)] = acc;
      }
    }
  }
}

void run_scalar_phase(const Plan& plan, size_t phase_index, double* table, int groups) {
  const Program& p = plan.program;
  const Graph& g = p.graph;
  const ScalarLayout& L = plan.layout;
  const ElementPhase& next = plan.phases.at(phase_index);
  bool final_phase = next.kind == ElementPhase::Kind::Update;
  int limit = plan.value_level_limit(next);  // uniform levels available to this phase
  std::vector<double> val(g.size(), 0.0);
  for (int grp = 0; grp < groups; ++grp) {
    double steps = table[L.steps_offset(groups) + grp];
    for (size_t i = 0; i < g.size(); ++i) {
      if (plan.kind[i] != ValueKind::Uniform || plan.level[i] > limit) continue;
      const Node& n = g.node(static_cast<NodeId>(i));
      switch (n.op) {
        case Op::Const: val[i] = n.value; break;
        case Op::Hyper: val[i] = table[L.hypers_offset() + grp * L.hypers_per_group + n.index]; break;
        case Op::Step: val[i] = steps + 1; break;
        case Op::Global: val[i] = table[L.globals_offset() + n.index]; break;
        case Op::UniformState:  // the value before this step: the commit below comes after every read
          val[i] = table[L.uniform_states_offset(groups) + grp * L.uniform_states_per_group + n.index];
          break;
        case Op::SumSquares:
        case Op::AnyNonFinite: {
          val[i] = table[L.reductions_offset() + plan.reduction_area_slot[plan.reduction_index(static_cast<NodeId>(i))]];
          break;
        }
        default: {
          double x = val[static_cast<size_t>(n.in[0])];
          double y = op_arity(n.op) > 1 ? val[static_cast<size_t>(n.in[1])] : 0.0;
          double z = op_arity(n.op) > 2 ? val[static_cast<size_t>(n.in[2])] : 0.0;
          val[i] = apply_op<double>(n.op, x, y, z);
        }
      }
    }
    for (size_t d = 0; d < plan.derived.size(); ++d)
      if (plan.level[static_cast<size_t>(plan.derived[d])] <= limit)
        table[L.derived_offset(groups) + grp * L.derived_per_group + static_cast<int>(d)] =
            val[static_cast<size_t>(plan.derived[d])];
    if (final_phase) {
      bool skip = p.skip != kNoNode && val[static_cast<size_t>(p.skip)] != 0.0;
      table[L.skip_offset(groups) + grp] = skip ? 1.0 : 0.0;
      if (!skip) {
        table[L.steps_offset(groups) + grp] = steps + 1;
        for (size_t u = 0; u < p.uniform_state_out.size(); ++u)
          table[L.uniform_states_offset(groups) + grp * L.uniform_states_per_group + static_cast<int>(u)] =
              val[static_cast<size_t>(p.uniform_state_out[u])];
      }
    }
  }
}

void eval_tensor_values(const Plan& plan, int limit, const double* derived_row, const double* reductions_row,
                        std::vector<double>& val) {
  const Graph& g = plan.program.graph;
  auto input = [&](NodeId in) {
    const Node& n = g.node(in);
    if (n.op == Op::Const) return n.value;
    if (plan.kind[static_cast<size_t>(in)] == ValueKind::Uniform) return derived_row[plan.derived_slot.at(in)];
    return val[static_cast<size_t>(in)];
  };
  for (size_t i = 0; i < g.size(); ++i) {
    if (plan.kind[i] != ValueKind::Tensor || plan.level[i] > limit) continue;
    const Node& n = g.node(static_cast<NodeId>(i));
    if (op_is_reduction(n.op)) {
      val[i] = reductions_row[plan.reduction_area_slot[plan.reduction_index(static_cast<NodeId>(i))]];
      continue;
    }
    double x = input(n.in[0]);
    double y = op_arity(n.op) > 1 ? input(n.in[1]) : 0.0;
    double z = op_arity(n.op) > 2 ? input(n.in[2]) : 0.0;
    val[i] = apply_op<double>(n.op, x, y, z);
  }
}

template <class T>
void run_element_phase(const Plan& plan, const ElementPhase& phase, const std::vector<TensorRef>& tensors,
                       const std::vector<Chunk>& chunks, size_t first, size_t last, const double* table,
                       int groups, const std::vector<double>& tensor_reductions,
                       std::vector<std::vector<double>>& partials) {
  const Program& p = plan.program;
  const Graph& g = p.graph;
  const ScalarLayout& L = plan.layout;
  bool update = phase.kind == ElementPhase::Kind::Update;
  std::vector<T> val(g.size(), T(0));
  std::vector<double> tensor_val(plan.tensor_derived.empty() ? 0 : g.size(), 0.0);
  std::vector<size_t> red_slot;
  for (NodeId r : phase.reductions) red_slot.push_back(plan.reduction_index(r));
  for (size_t c = first; c < last; ++c) {
    const Chunk& ch = chunks[c];
    const TensorRef& t = tensors[static_cast<size_t>(ch.tensor)];
    int grp = t.group;
    if (update && table[L.skip_offset(groups) + grp] != 0.0) continue;
    // Uniform inputs, rounded to T as they enter element math.
    const double* derived = table + L.derived_offset(groups) + grp * L.derived_per_group;
    for (size_t d = 0; d < plan.derived.size(); ++d)
      val[static_cast<size_t>(plan.derived[d])] = static_cast<T>(derived[d]);
    if (!plan.tensor_derived.empty()) {  // this tensor's values, float64, rounded as they enter element math
      eval_tensor_values(plan, plan.value_level_limit(phase), derived,
                         tensor_reductions.data() + static_cast<size_t>(ch.tensor) * static_cast<size_t>(L.tensor_reductions),
                         tensor_val);
      for (NodeId id : plan.tensor_derived) val[static_cast<size_t>(id)] = static_cast<T>(tensor_val[static_cast<size_t>(id)]);
    }
    for (size_t i = 0; i < g.size(); ++i)
      if (g.node(static_cast<NodeId>(i)).op == Op::Const) val[i] = static_cast<T>(g.node(static_cast<NodeId>(i)).value);
    std::vector<double> acc(phase.reductions.size(), 0.0);
    // Stochastic rounding's stream: the group's step count, already advanced by the scalar phase.
    const uint64_t rng = update ? lowp::rng_base(t.rng_key, static_cast<uint64_t>(table[L.steps_offset(groups) + grp])) : 0;
    auto store = [&](const Buffer& b, int role, int64_t e, T v) {
      if (b.stochastic_rounding)
        lowp::store_element_sr(b.data, b.dtype, e, static_cast<double>(v),
                               lowp::rng_bits(rng, static_cast<uint64_t>(t.rng_offset + e), role));
      else
        store_element(b.data, b.dtype, e, static_cast<double>(v));
    };
    for (int64_t e = ch.begin; e < ch.begin + ch.length; ++e) {
      for (NodeId id : phase.nodes) {
        const Node& n = g.node(id);
        size_t i = static_cast<size_t>(id);
        switch (n.op) {
          case Op::Param: val[i] = static_cast<T>(load_element(t.param.data, t.param.dtype, e)); break;
          case Op::Grad: val[i] = static_cast<T>(load_element(t.grad.data, t.grad.dtype, e)); break;
          case Op::State: {
            const Buffer& b = t.states[static_cast<size_t>(n.index)];
            val[i] = static_cast<T>(load_element(b.data, b.dtype, e));
            break;
          }
          default: {
            T x = val[static_cast<size_t>(n.in[0])];
            T y = op_arity(n.op) > 1 ? val[static_cast<size_t>(n.in[1])] : T(0);
            T z = op_arity(n.op) > 2 ? val[static_cast<size_t>(n.in[2])] : T(0);
            val[i] = apply_op<T>(n.op, x, y, z);
          }
        }
      }
      for (size_t r = 0; r < phase.reductions.size(); ++r) {
        const Node& rn = g.node(phase.reductions[r]);
        double x = static_cast<double>(val[static_cast<size_t>(rn.in[0])]);
        if (rn.op == Op::SumSquares) acc[r] += x * x;
        else if (!std::isfinite(x)) acc[r] = 1.0;
      }
      if (update) {
        for (int s : phase.writes_states)
          store(t.states[static_cast<size_t>(s)], 2 + s, e, val[static_cast<size_t>(p.state_out[static_cast<size_t>(s)])]);
        store(t.param, 0, e, val[static_cast<size_t>(p.param_out)]);
      }
    }
    for (size_t r = 0; r < phase.reductions.size(); ++r) partials[red_slot[r]][c] = acc[r];
  }
}

template void run_element_phase<double>(const Plan&, const ElementPhase&, const std::vector<TensorRef>&,
                                        const std::vector<Chunk>&, size_t, size_t, const double*, int,
                                        const std::vector<double>&, std::vector<std::vector<double>>&);
template void run_element_phase<float>(const Plan&, const ElementPhase&, const std::vector<TensorRef>&,
                                       const std::vector<Chunk>&, size_t, size_t, const double*, int,
                                       const std::vector<double>&, std::vector<std::vector<double>>&);

}  // namespace optfuse
