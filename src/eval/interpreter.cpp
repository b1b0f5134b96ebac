#include "eval/interpreter.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ir/low_precision.h"
#include "optfuse/error.h"
#include "runtime/thread_pool.h"

namespace optfuse {

// Host loops of this many items or more are split over the thread pool (below, its wake-up costs
// more than the work).
constexpr int64_t kThreadedItems = int64_t{1} << 16;

void set_globals(double* table, const StepInputs& in) {
  table[kGradScale] = in.grad_scale ? static_cast<double>(*in.grad_scale) : 1.0;
  table[kFoundInf] = in.found_inf ? static_cast<double>(*in.found_inf) : 0.0;
}

namespace {
// How a reduction folds one more contribution in: OR for AnyNonFinite, a NaN-propagating max for
// MaxAbs, else a sum.
double reduce_add(Op op, double acc, double v) {
  if (op == Op::AnyNonFinite) return acc != 0 || v != 0 ? 1.0 : 0.0;
  if (op == Op::MaxAbs) return apply_op<double>(Op::Max, acc, v, 0.0);
  return acc + v;
}
// One element's (or one row or column value's) contribution to a reduction.
double contribution(Op op, double x) {
  switch (op) {
    case Op::SumSquares: return x * x;
    case Op::Sum: return x;
    case Op::MaxAbs: return std::fabs(x);
    default: return std::isfinite(x) ? 0.0 : 1.0;  // AnyNonFinite
  }
}
}  // namespace

void combine_partials(const Plan& plan, size_t phase, const std::function<const double*(size_t)>& row,
                      const std::vector<ChunkRange>& spans, int64_t columns, double* table,
                      std::vector<double>& tensor_reductions, MatrixTables* m) {
  const Graph& g = plan.program.graph;
  const ScalarLayout& L = plan.layout;
  for (NodeId node : plan.phases.at(phase).reductions) {
    const size_t r = plan.reduction_index(node);
    const Op op = g.node(node).op;
    auto add = [op](double acc, double v) { return reduce_add(op, acc, v); };
    const int slot = plan.reduction_area_slot[r];
    const double* partials = row(r);
    if (plan.scope_of(r) == Scope::Row) continue;  // written whole by the pass: a chunk holds whole rows
    if (plan.scope_of(r) == Scope::Col) {  // per column: the column partials of the tensor's chunks, in order
      if (m == nullptr) throw Error("combine_partials: column reductions need the matrix tables");
      const MatrixLayout& ml = m->layout;
      const int64_t cr = L.col_reductions;
      for (size_t t = 0; t < spans.size(); ++t) {
        if (spans[t].count == 0) continue;
        const int64_t C = ml.view_cols[t], per = ml.chunks_per_matrix[t];
        // Column c of matrix b: the partials of the matrix's chunks, in chunk order. Chunk by chunk
        // over a run of columns (the partials of one chunk are contiguous), not column by column
        // (a stride of a chunk's partials per add); runs of columns split across threads. Each
        // column's sum is the same fold in the same order either way.
        const double* part = m->col_partials.data() + ml.colpart_offset[t] * cr + slot;
        double* out = m->col_reductions.data() + ml.col_offset[t] * cr + slot;
        auto columns_of = [&](int64_t x0, int64_t x1) {
          for (int64_t x = x0; x < x1; ++x) out[x * cr] = 0.0;
          for (int64_t x = x0; x < x1;) {  // the columns of matrix b in [x0, x1)
            const int64_t b = x / C, end = std::min(x1, (b + 1) * C);
            for (int64_t j = b * per; j < (b + 1) * per; ++j) {
              const double* pj = part + (j * C - b * C) * cr;
              if (op == Op::Sum || op == Op::SumSquares) {
                for (int64_t y = x; y < end; ++y) out[y * cr] += pj[y * cr];
              } else {
                for (int64_t y = x; y < end; ++y) out[y * cr] = add(out[y * cr], pj[y * cr]);
              }
            }
            x = end;
          }
        };
        const int64_t columns_of_t = ml.cols_of(t);
        if (columns_of_t * per >= kThreadedItems) default_thread_pool().parallel_for(columns_of_t, columns_of);
        else columns_of(0, columns_of_t);
      }
      continue;
    }
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
        case Op::Sum:
        case Op::MaxAbs:
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

std::array<double, 4> shape_values(const TensorRef& t) {
  const MatrixView v = matrix_view(t);
  return {static_cast<double>(t.param.numel), static_cast<double>(v.matrix_rows), static_cast<double>(v.cols), v.is_matrix ? 1.0 : 0.0};
}

void eval_tensor_values(const Plan& plan, const std::vector<NodeId>& nodes, const double* derived_row,
                        const double* reductions_row, const double* shape, std::vector<double>& val, const double* sums_row) {
  const Graph& g = plan.program.graph;
  auto input = [&](NodeId in) {
    const Node& n = g.node(in);
    if (n.op == Op::Const) return n.value;
    if (plan.kind[static_cast<size_t>(in)] == ValueKind::Uniform) return derived_row[plan.derived_slot.at(in)];
    return val[static_cast<size_t>(in)];
  };
  for (NodeId id : nodes) {
    const size_t i = static_cast<size_t>(id);
    const Node& n = g.node(id);
    if (op_is_reduction(n.op)) {
      const bool of_values = sums_row != nullptr && plan.is_value_reduction(static_cast<NodeId>(i));
      val[i] = (of_values ? sums_row : reductions_row)[plan.reduction_area_slot[plan.reduction_index(static_cast<NodeId>(i))]];
      continue;
    }
    if (n.op == Op::Shape) {
      val[i] = shape[n.index];
      continue;
    }
    double x = input(n.in[0]);
    double y = op_arity(n.op) > 1 ? input(n.in[1]) : 0.0;
    double z = op_arity(n.op) > 2 ? input(n.in[2]) : 0.0;
    val[i] = apply_op<double>(n.op, x, y, z);
  }
}

// Whether a tensor computes in float64 (a role is float64: codegen's variant_computes_f64): the
// float32 interpreter, which mirrors generated code, runs its chunks in double as that code does.
static bool computes_f64(const TensorRef& t) {
  if (t.param.dtype == DType::f64 || t.grad.dtype == DType::f64) return true;
  for (const Buffer& b : t.states)
    if (b.dtype == DType::f64) return true;
  return false;
}

// Element e of a role's buffer, of any storage dtype.
static double load_buffer(const Buffer& b, int64_t e) {
  return b.dtype == DType::q8 ? load_q8_element(b.data, b.numel, e) : load_element(b.data, b.dtype, e);
}

template <class T>
void run_element_phase(const Plan& plan, size_t phase_index, const std::vector<TensorRef>& tensors,
                       const std::vector<Chunk>& chunks, size_t first, size_t last, const double* table,
                       int groups, const std::vector<double>& tensor_reductions,
                       std::vector<std::vector<double>>& partials, MatrixTables* m) {
  if constexpr (std::is_same_v<T, float>) {  // runs of chunks of float64 tensors in double
    auto f64 = [&](size_t c) { return computes_f64(tensors[static_cast<size_t>(chunks[c].tensor)]); };
    bool mixed = false;
    for (size_t c = first; c < last && !mixed; ++c) mixed = f64(c);
    if (mixed) {
      for (size_t c = first; c < last;) {
        size_t e = c + 1;
        while (e < last && f64(e) == f64(c)) ++e;
        if (f64(c))
          run_element_phase<double>(plan, phase_index, tensors, chunks, c, e, table, groups, tensor_reductions, partials, m);
        else
          run_element_phase<float>(plan, phase_index, tensors, chunks, c, e, table, groups, tensor_reductions, partials, m);
        c = e;
      }
      return;
    }
  }
  const ElementPhase& phase = plan.phases.at(phase_index);  // (its recomputing form has the same kind and reductions)
  const Program& p = plan.program;
  if (plan.matrix() && m == nullptr) throw Error("run_element_phase: a matrix plan needs its matrix tables");
  const Graph& g = p.graph;
  const ScalarLayout& L = plan.layout;
  bool update = phase.kind == ElementPhase::Kind::Update;
  std::vector<T> val(g.size(), T(0));
  std::vector<double> tensor_val(plan.tensor_derived.empty() ? 0 : g.size(), 0.0);
  const std::vector<NodeId> tensor_nodes = plan.tensor_value_nodes(plan.value_level_limit(phase));
  const std::vector<NodeId> matrix_nodes = plan.tensor_value_nodes(plan.value_level_limit(phase), true);
  std::vector<size_t> red_slot;
  for (NodeId r : phase.reductions) red_slot.push_back(plan.reduction_index(r));
  // Each form of the phase a tensor may run (Plan::phase_for), with the nodes it reads from a state
  // an earlier pass wrote.
  struct Form {
    const ElementPhase* phase;
    std::vector<int> loaded_state;
  };
  std::array<Form, 2> forms;  // [states_ahead]
  for (bool ahead : {false, true}) {
    Form& f = forms[ahead];
    f.phase = &plan.phase_for(phase_index, ahead);
    f.loaded_state.assign(g.size(), -1);
    for (const auto& [node, state] : f.phase->loads) f.loaded_state[static_cast<size_t>(node)] = state;
  }
  std::vector<DType> state_dtypes(p.states.size());
  for (size_t c = first; c < last; ++c) {
    const Chunk& ch = chunks[c];
    const TensorRef& t = tensors[static_cast<size_t>(ch.tensor)];
    for (size_t s = 0; s < state_dtypes.size(); ++s) state_dtypes[s] = t.states[s].dtype;
    const Form& form = forms[plan.runs_states_ahead(state_dtypes)];
    const std::vector<int>& loaded_state = form.loaded_state;
    int grp = t.group;
    if (update && table[L.skip_offset(groups) + grp] != 0.0) continue;
    // Uniform inputs, rounded to T as they enter element math.
    const double* derived = table + L.derived_offset(groups) + grp * L.derived_per_group;
    for (size_t d = 0; d < plan.derived.size(); ++d)
      val[static_cast<size_t>(plan.derived[d])] = static_cast<T>(derived[d]);
    const MatrixView view = matrix_view(t);
    const size_t tix = static_cast<size_t>(ch.tensor);
    // This tensor's values, float64, rounded as they enter element math: per matrix of the view in
    // a matrix plan (they may read the matrix's sums of row values; entering a matrix evaluates them).
    const std::array<double, 4> shape = plan.tensor_derived.empty() ? std::array<double, 4>{} : shape_values(t);
    auto tensor_values = [&](int64_t matrix, const std::vector<NodeId>& nodes) {
      if (plan.tensor_derived.empty()) return;
      eval_tensor_values(plan, nodes, derived, tensor_reductions.data() + tix * static_cast<size_t>(L.tensor_reductions),
                         shape.data(), tensor_val, m ? m->matrix_sums.data() + m->sums_at(tix, matrix) : nullptr);
      for (NodeId id : plan.tensor_derived) val[static_cast<size_t>(id)] = static_cast<T>(tensor_val[static_cast<size_t>(id)]);
    };
    if (!m) tensor_values(0, tensor_nodes);
    for (size_t i = 0; i < g.size(); ++i)
      if (g.node(static_cast<NodeId>(i)).op == Op::Const) val[i] = static_cast<T>(g.node(static_cast<NodeId>(i)).value);
    std::vector<double> acc(phase.reductions.size(), 0.0);
    // Stochastic rounding's stream: the group's step count, already advanced by the scalar phase.
    // (Only the update pass rounds stochastically: states written ahead are float32.)
    const uint64_t rng = update ? lowp::rng_base(t.rng_key, static_cast<uint64_t>(table[L.steps_offset(groups) + grp])) : 0;
    // q8 states the pass writes: the chunk's new values, encoded a block at a time once the chunk's
    // elements are done (a block's scale depends on all its values; chunks hold whole blocks).
    std::vector<std::vector<double>> q8_new(t.states.size());
    for (int s : form.phase->writes_states)
      if (t.states[static_cast<size_t>(s)].dtype == DType::q8) q8_new[static_cast<size_t>(s)].assign(static_cast<size_t>(ch.length), 0.0);
    auto store = [&](const Buffer& b, int role, int64_t e, T v) {
      if (b.dtype == DType::q8) {
        q8_new[static_cast<size_t>(role - 2)][static_cast<size_t>(e - ch.begin)] = static_cast<double>(v);
        return;
      }
      if (b.stochastic_rounding)
        lowp::store_element_sr(b.data, b.dtype, e, static_cast<double>(v),
                               lowp::rng_bits(rng, static_cast<uint64_t>(t.rng_offset + e), role));
      else
        store_element(b.data, b.dtype, e, static_cast<double>(v));
    };
    // Matrix plans: the chunk holds whole rows, of one matrix of the view or of several whole small
    // ones (matrix_tables.h). Per matrix entered: its first column and its column partials (the
    // chunk's own where a matrix has several chunks, else the matrix's), zeroed, and its tensor values.
    const size_t RR = static_cast<size_t>(L.row_reductions), CR = static_cast<size_t>(L.col_reductions);
    const size_t RV = static_cast<size_t>(L.row_values), CV = static_cast<size_t>(L.col_values);
    const int64_t row0 = m ? m->layout.row_offset[tix] : 0;
    const int64_t chunk_in_tensor = m ? static_cast<int64_t>(c) - m->layout.first_chunk[tix] : 0;
    int64_t matrix = -1, col0 = 0, part0 = 0;
    auto enter_matrix = [&](int64_t b) {
      const int64_t pr = m->layout.chunks_per_matrix[tix] > 1 ? chunk_in_tensor : b;
      col0 = m->layout.col_offset[tix] + b * view.cols;
      part0 = m->layout.colpart_offset[tix] + pr * view.cols;
      for (int64_t k = 0; k < view.cols * static_cast<int64_t>(CR); ++k) m->col_partials[static_cast<size_t>(part0 * static_cast<int64_t>(CR) + k)] = 0.0;
      tensor_values(b, matrix == -1 ? tensor_nodes : matrix_nodes);  // (a later matrix: those that read its sums)
      matrix = b;
    };
    std::vector<double> row_acc(phase.reductions.size(), 0.0);
    for (int64_t e = ch.begin; e < ch.begin + ch.length; ++e) {
      const int64_t row = e / view.cols, col = e % view.cols;
      if (m && row / view.matrix_rows != matrix) enter_matrix(row / view.matrix_rows);
      if (m) {
        for (size_t k = 0; k < RV; ++k)
          val[static_cast<size_t>(plan.row_derived[k])] = static_cast<T>(m->row_values[static_cast<size_t>(row0 + row) * RV + k]);
        for (size_t k = 0; k < CV; ++k)
          val[static_cast<size_t>(plan.col_derived[k])] = static_cast<T>(m->col_values[static_cast<size_t>(col0 + col) * CV + k]);
      }
      for (NodeId id : form.phase->nodes) {
        const Node& n = g.node(id);
        size_t i = static_cast<size_t>(id);
        if (loaded_state[i] >= 0) {
          val[i] = static_cast<T>(load_buffer(t.states[static_cast<size_t>(loaded_state[i])], e));
          continue;
        }
        switch (n.op) {
          case Op::Param: val[i] = static_cast<T>(load_element(t.param.data, t.param.dtype, e)); break;
          case Op::Grad: val[i] = static_cast<T>(load_element(t.grad.data, t.grad.dtype, e)); break;
          case Op::State: val[i] = static_cast<T>(load_buffer(t.states[static_cast<size_t>(n.index)], e)); break;
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
        const double v = contribution(rn.op, static_cast<double>(val[static_cast<size_t>(rn.in[0])]));
        const size_t slot = static_cast<size_t>(plan.reduction_area_slot[red_slot[r]]);
        switch (reduction_scope(rn)) {
          case Scope::Row:  // in element order along the row; written when the row ends
            row_acc[r] = reduce_add(rn.op, row_acc[r], v);
            if (col == view.cols - 1) {
              m->row_reductions[static_cast<size_t>(row0 + row) * RR + slot] = row_acc[r];
              row_acc[r] = 0.0;
            }
            break;
          case Scope::Col: {
            double& part = m->col_partials[static_cast<size_t>(part0 + col) * CR + slot];
            part = reduce_add(rn.op, part, v);
            break;
          }
          default: acc[r] = reduce_add(rn.op, acc[r], v);
        }
      }
      const ElementPhase& ran = *form.phase;
      for (size_t k = 0; k < ran.writes_states.size(); ++k) {
        const int s = ran.writes_states[k];
        store(t.states[static_cast<size_t>(s)], 2 + s, e, val[static_cast<size_t>(ran.write_values[k])]);
      }
      if (ran.writes_param) store(t.param, 0, e, val[static_cast<size_t>(p.param_out)]);
    }
    for (size_t s = 0; s < q8_new.size(); ++s) {
      if (q8_new[s].empty()) continue;
      const Buffer& b = t.states[s];
      for (int64_t k = 0; k < ch.length; k += kQ8Block)
        store_q8_block(b.data, b.numel, ch.begin + k, std::min<int64_t>(kQ8Block, ch.length - k), q8_new[s].data() + k);
    }
    for (size_t r = 0; r < phase.reductions.size(); ++r) partials[red_slot[r]][c] = acc[r];
  }
}

template void run_element_phase<double>(const Plan&, size_t, const std::vector<TensorRef>&,
                                        const std::vector<Chunk>&, size_t, size_t, const double*, int,
                                        const std::vector<double>&, std::vector<std::vector<double>>&, MatrixTables*);
template void run_element_phase<float>(const Plan&, size_t, const std::vector<TensorRef>&,
                                       const std::vector<Chunk>&, size_t, size_t, const double*, int,
                                       const std::vector<double>&, std::vector<std::vector<double>>&, MatrixTables*);


namespace {

// One row's or column's values in the Values step, in graph order into val: its Rows / Cols states
// (element `state_element` of them), its row / column reductions of element values (from their
// pass: `reductions`, this line's entry of its table; slot_of[node] the slot in it) and its math.
template <class T>
void eval_line(const Graph& g, const std::vector<NodeId>& nodes, const TensorRef& ref, int64_t state_element,
               const double* reductions, const std::vector<size_t>& slot_of, std::vector<T>& val) {
  for (NodeId id : nodes) {
    const Node& n = g.node(id);
    const size_t i = static_cast<size_t>(id);
    if (n.op == Op::State) {
      const Buffer& buf = ref.states[static_cast<size_t>(n.index)];
      val[i] = static_cast<T>(load_element(buf.data, buf.dtype, state_element));
    } else if (op_is_reduction(n.op)) {
      val[i] = static_cast<T>(reductions[slot_of[i]]);
    } else {
      T a = val[static_cast<size_t>(n.in[0])];
      T y = op_arity(n.op) > 1 ? val[static_cast<size_t>(n.in[1])] : T(0);
      T z = op_arity(n.op) > 2 ? val[static_cast<size_t>(n.in[2])] : T(0);
      val[i] = apply_op<T>(n.op, a, y, z);
    }
  }
}

}  // namespace

template <class T>
void run_values_step(const Plan& plan, size_t phase, const std::vector<TensorRef>& tensors, const double* table,
                     int groups, std::vector<double>& tensor_reductions, MatrixTables& m) {
  const Graph& g = plan.program.graph;
  const ScalarLayout& L = plan.layout;
  const int limit = plan.value_level_limit(plan.phases.at(phase));
  const size_t RR = static_cast<size_t>(L.row_reductions), CR = static_cast<size_t>(L.col_reductions);
  const size_t RV = static_cast<size_t>(L.row_values), CV = static_cast<size_t>(L.col_values);
  const size_t RT = static_cast<size_t>(L.tensor_reductions);
  const std::vector<NodeId> tensor_nodes = plan.tensor_value_nodes(limit), matrix_nodes = plan.tensor_value_nodes(limit, true);
  // The nodes of each kind to evaluate, and the sums of them, of the levels this pass may read.
  std::vector<NodeId> nodes[2], sums[2];
  for (size_t i = 0; i < g.size(); ++i) {
    const ValueKind k = plan.kind[i];
    const NodeId id = static_cast<NodeId>(i);
    if (plan.level[i] > limit) continue;
    if (k == ValueKind::Row || k == ValueKind::Col) nodes[k == ValueKind::Col].push_back(id);
    if (op_is_reduction(g.node(id).op) && plan.is_value_reduction(id))
      sums[plan.kind[static_cast<size_t>(g.node(id).in[0])] == ValueKind::Col].push_back(id);
  }
  // Each reduction's slot in its table, found once (this runs per row and column of every matrix).
  std::vector<size_t> slot_of(g.size(), 0);
  for (size_t r = 0; r < plan.reductions.size(); ++r)
    slot_of[static_cast<size_t>(plan.reductions[r])] = static_cast<size_t>(plan.reduction_area_slot[r]);
  // Matrices are independent (their rows, columns and sums are their own): split across threads,
  // each with its own scratch. A thread entering a tensor evaluates all of its tensor values, then,
  // per further matrix, those that read the matrix's sums.
  const MatrixLayout& ml = m.layout;
  default_thread_pool().parallel_for(ml.matrices, [&](int64_t k0, int64_t k1) {
    std::vector<T> val_t(g.size(), T(0));
    std::vector<double> val_f64;  // (the float32 interpreter's float64 tensors: in double, as generated code)
    std::vector<double> tensor_val(g.size(), 0.0);
    std::vector<double> acc[2] = {std::vector<double>(sums[0].size()), std::vector<double>(sums[1].size())};
    size_t t = static_cast<size_t>(std::upper_bound(ml.matrix_offset.begin(), ml.matrix_offset.end(), k0) - ml.matrix_offset.begin()) - 1;
    for (int64_t k = k0; k < k1;) {
      while (t + 1 < tensors.size() && ml.matrix_offset[t + 1] <= k) ++t;
      const TensorRef& ref = tensors[t];
      const MatrixView view = matrix_view(ref);
      const int64_t first_b = k - ml.matrix_offset[t], last_b = std::min(view.matrices, k1 - ml.matrix_offset[t]);
      k = ml.matrix_offset[t] + std::max(last_b, first_b + 1);
      if (ref.param.numel == 0) continue;  // no rows: its column (if any) has no values either (as on CUDA)
      const double* derived = table + L.derived_offset(groups) + ref.group * L.derived_per_group;
      const std::array<double, 4> shape = shape_values(ref);
      auto run = [&](auto& val) {
        using V = typename std::decay_t<decltype(val)>::value_type;
        // Uniform inputs, rounded to V as they enter row and column math (as element math).
        for (size_t d = 0; d < plan.derived.size(); ++d) val[static_cast<size_t>(plan.derived[d])] = static_cast<V>(derived[d]);
        for (size_t i = 0; i < g.size(); ++i)
          if (g.node(static_cast<NodeId>(i)).op == Op::Const) val[i] = static_cast<V>(g.node(static_cast<NodeId>(i)).value);
        for (int64_t b = first_b; b < last_b; ++b) {  // matrix by matrix: its tensor values read its sums
          double* sums_row = m.matrix_sums.data() + m.sums_at(t, b);
          eval_tensor_values(plan, b == first_b ? tensor_nodes : matrix_nodes, derived, tensor_reductions.data() + t * RT,
                             shape.data(), tensor_val, sums_row);
          for (NodeId id : plan.tensor_derived) val[static_cast<size_t>(id)] = static_cast<V>(tensor_val[static_cast<size_t>(id)]);
          for (int side = 0; side < 2; ++side) {  // rows, then columns
            const bool cols = side == 1;
            const int64_t count = cols ? view.cols : view.matrix_rows;
            const int64_t first = cols ? m.layout.col_offset[t] + b * view.cols : m.layout.row_offset[t] + b * view.matrix_rows;
            const int64_t element0 = cols ? b * view.cols : b * view.matrix_rows;  // of the Rows / Cols state
            const std::vector<double>& reductions = cols ? m.col_reductions : m.row_reductions;
            std::vector<double>& values = cols ? m.col_values : m.row_values;
            const std::vector<NodeId>& derived_ids = cols ? plan.col_derived : plan.row_derived;
            const size_t per_red = cols ? CR : RR, per_val = cols ? CV : RV;
            std::fill(acc[side].begin(), acc[side].end(), 0.0);
            for (int64_t x = 0; x < count; ++x) {
              eval_line(g, nodes[side], ref, element0 + x, reductions.data() + static_cast<size_t>(first + x) * per_red, slot_of, val);
              for (size_t d = 0; d < derived_ids.size(); ++d)
                if (plan.level[static_cast<size_t>(derived_ids[d])] <= limit)
                  values[static_cast<size_t>(first + x) * per_val + d] = static_cast<double>(val[static_cast<size_t>(derived_ids[d])]);
              for (size_t q = 0; q < sums[side].size(); ++q) {
                const Node& rn = g.node(sums[side][q]);
                acc[side][q] = reduce_add(rn.op, acc[side][q], contribution(rn.op, static_cast<double>(val[static_cast<size_t>(rn.in[0])])));
              }
            }
            for (size_t q = 0; q < sums[side].size(); ++q) sums_row[slot_of[static_cast<size_t>(sums[side][q])]] = acc[side][q];
          }
        }
      };
      if constexpr (std::is_same_v<T, float>) {
        if (computes_f64(ref)) {
          val_f64.resize(g.size(), 0.0);
          run(val_f64);
          continue;
        }
      }
      run(val_t);
    }
  });
}

template void run_values_step<double>(const Plan&, size_t, const std::vector<TensorRef>&, const double*, int,
                                      std::vector<double>&, MatrixTables&);
template void run_values_step<float>(const Plan&, size_t, const std::vector<TensorRef>&, const double*, int,
                                     std::vector<double>&, MatrixTables&);

void commit_matrix_states(const Plan& plan, const std::vector<TensorRef>& tensors, const double* table, int groups,
                          const MatrixTables& m) {
  const Program& p = plan.program;
  const ScalarLayout& L = plan.layout;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorRef& ref = tensors[t];
    if (table[L.skip_offset(groups) + ref.group] != 0.0 || ref.param.numel == 0) continue;
    const MatrixView view = matrix_view(ref);
    for (size_t s = 0; s < p.states.size(); ++s) {
      const StateShape shape = p.states[s].shape;
      if (shape == StateShape::Full) continue;
      const bool cols = shape == StateShape::Cols;
      const NodeId out = p.state_out[s];
      const Buffer& b = ref.states[s];
      const int64_t count = cols ? view.columns() : view.rows, first = cols ? m.layout.col_offset[t] : m.layout.row_offset[t];
      if (p.graph.node(out).op == Op::Const) {
        for (int64_t x = 0; x < count; ++x) store_element(b.data, b.dtype, x, p.graph.node(out).value);
        continue;
      }
      const size_t per = static_cast<size_t>(cols ? L.col_values : L.row_values);
      const size_t k = plan.line_value_index(out);
      const std::vector<double>& values = cols ? m.col_values : m.row_values;
      auto copy = [&](int64_t x0, int64_t x1) {
        for (int64_t x = x0; x < x1; ++x) store_element(b.data, b.dtype, x, values[static_cast<size_t>(first + x) * per + k]);
      };
      if (count >= kThreadedItems) default_thread_pool().parallel_for(count, copy);  // (a batch of small matrices' rows)
      else copy(0, count);
    }
  }
}

}  // namespace optfuse
