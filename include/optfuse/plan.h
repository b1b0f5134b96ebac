// The plan: a program after passes, cut into the fewest passes over memory.
//
// Every node has a kind: *uniform* (one value per parameter group, computed once per step in
// float64 by the scalar phase), *tensor* (one value per tensor, float64: anything that reads a
// per-tensor reduction, e.g. LAMB's trust ratio) or *element* (one value per tensor element,
// computed in float32 inside a pass over memory). A node's *level* counts the reductions beneath it:
// level 0 needs none; a reduction of a level-L element value has level L+1 (any scope). The plan is
//   for L = 1..max: scalar phase (uniforms of level < L) -> reduce phase L (one pass over memory)
//   final scalar phase (all uniforms; decide skip; commit the step count and uniform states) -> update phase
// so clip_by_global_norm + adamw is one read of the gradients and one read/write of everything.
// A reduction whose users all sit at a higher level moves to that level's reduce pass when the pass
// reads its inputs anyway (LAMB's ||param|| joins ||update||): the same answer in fewer bytes.
// The last reduce pass writes the new values of states that need none of its reductions when the
// update pass then reads fewer roles (it reads them back instead of recomputing them from their
// inputs): LAMB's m and v, so its update pass reads m, v and the parameter but not the gradient.
//
// Scalars live in one float64 table (on the device for CUDA), laid out as
//   globals[kNumGlobals] | reductions[R] | hypers[G x H] | steps[G] | skip[G] | ustate[G x S] | derived[G x D]
// where `ustate` holds the groups' uniform states (Program::uniform_states: read by every scalar
// phase, their new values committed by the final one where the step is not skipped, as the step
// count) and `derived` the uniform values element or tensor code reads (bias corrections, clip
// coefficient, ...). Sizes depend on the group count G, never on tensor shapes. Per-tensor
// reductions live in a second table, tensor_reductions[T x RT] (T tensors), combined per tensor from
// the per-chunk partials in chunk order. Tensor values are evaluated where they are used: at the
// start of every chunk, from the group's derived row and the tensor's reductions (a few float64
// operations per chunk), and handed to element code after the derived values: u = [derived | tensor].
//
// Matrix plans (Adafactor): a tensor may be viewed as a matrix (TensorRef::cols). *Row* and *column*
// values are one per row / column of it: Rows / Cols state slots, row / column reductions of element
// values (level + 1, like any reduction of element values) and float32 math on them and on uniform
// and tensor values. A row and a column value meeting make an element value. Before each pass, the
// schedule's Values step evaluates every row and column value of the levels that pass may read into
// the row and column value tables (the reductions they read are complete: a row lies in one chunk,
// whose pass writes its sums; a column's per-chunk partials are combined in chunk order), and takes
// the per-tensor sums of row or column values (Sum over a Tensor, no pass of their own). Element
// code reads them after the tensor values: u = [derived | tensor | row | column]. Rows and Cols
// states are written by the Commit step after the update pass, from the value tables, where the
// step is not skipped. Chunks of a matrix plan hold whole rows.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "optfuse/dtype.h"
#include "optfuse/rule.h"
#include "optfuse/schedule.h"

namespace optfuse {

enum class ValueKind : uint8_t { Uniform, Tensor, Row, Col, Element };
const char* value_kind_name(ValueKind k);

struct ElementPhase {
  enum class Kind { Reduce, Update } kind = Kind::Update;
  int level = 0;
  std::vector<NodeId> nodes;       // element nodes evaluated per element, in topological order
  std::vector<NodeId> reductions;  // Reduce: the reduction nodes this pass produces
  bool reads_param = false, reads_grad = false, writes_param = false;
  std::vector<int> reads_states, writes_states;
  // The value each written state takes (writes_states[k] <- write_values[k]): its new value, or, in a
  // reduce pass that writes states ahead of the update (see write_states_ahead in make_plan.cpp),
  // `skip ? old : new` where the step may be skipped.
  std::vector<NodeId> write_values;
  // Update pass after such a reduce pass: element nodes read from a state's role (the new value the
  // reduce pass wrote) instead of computed: (node, state). Their states are in reads_states.
  std::vector<std::pair<NodeId, int>> loads;
  // The state whose role holds node `id`'s value in this pass, or -1.
  int load_of(NodeId id) const;
  // Tensor elements read and written per parameter element (times the storage size = bytes).
  int reads() const;
  int writes() const;
};

// The one definition of the plan's layout: the scalar table's areas and the slot counts of the
// per-tensor, per-row and per-column tables. The host executors and the interpreter read offsets
// from it, and every dialect's generated source prints its counts and offset functions from it
// (layout_source in codegen/abi.h), so the two sides cannot drift apart. Every area's offset in the
// scalar table is a + b * groups.
struct ScalarLayout {
  int hypers_per_group = 0, derived_per_group = 0, reductions = 0;  // reductions: global scope
  int uniform_states_per_group = 0;  // uniform states (Program::uniform_states), committed like steps
  int tensor_reductions = 0;  // per tensor, in the tensor_reductions table
  int tensor_values = 0;      // tensor values element code reads (u after the derived values)
  // Matrix plans: per row of every tensor, its row reductions and row values; per column, its column
  // reductions (and per chunk, their partials) and column values (u after the tensor values).
  int row_reductions = 0, col_reductions = 0, row_values = 0, col_values = 0;
  int globals_offset() const { return 0; }
  int reductions_offset() const { return kNumGlobals; }
  int hypers_offset() const { return kNumGlobals + reductions; }
  int steps_offset(int groups) const { return hypers_offset() + groups * hypers_per_group; }
  int skip_offset(int groups) const { return steps_offset(groups) + groups; }
  int uniform_states_offset(int groups) const { return skip_offset(groups) + groups; }
  int derived_offset(int groups) const { return uniform_states_offset(groups) + groups * uniform_states_per_group; }
  int size(int groups) const { return derived_offset(groups) + groups * derived_per_group; }
};

struct Plan {
  Program program;                      // after passes
  std::vector<ValueKind> kind;          // per node
  std::vector<int> level;               // per node
  std::vector<ElementPhase> phases;     // in execution order; the last is the update
  // Where the last reduce pass writes states ahead of the update (make_plan's write_states_ahead):
  // the two phases it replaced, that reduce pass without the writes and the update pass computing
  // every new state. A tensor whose states written ahead are not all float32 runs these, so no pass
  // reads a 16-bit state after rounding it: every storage keeps the same math. Else empty.
  std::vector<ElementPhase> recomputing;
  std::vector<NodeId> reductions;       // reduction (partials slot) -> node, every scope
  std::vector<int> reduction_area_slot; // reduction -> its slot in the global area or tensor table row
  std::vector<NodeId> tensor_derived;   // tensor values read by element code (u[D + k])
  std::vector<NodeId> row_derived;      // row values element code reads or Rows states take (u[D + TV + k])
  std::vector<NodeId> col_derived;      // column values likewise (u[D + TV + RV + k])
  std::vector<NodeId> derived;          // derived slot -> uniform node read by element code
  std::map<NodeId, int> derived_slot;   // node -> index in u: derived d -> d, tensor value k -> D + k
  ScalarLayout layout;
  std::vector<ScheduleStep> schedule;   // what a step does, in order (optfuse/schedule.h)
  std::vector<std::string> pass_log;    // "name: N nodes" per pass, for explain

  int num_states() const { return static_cast<int>(program.states.size()); }
  bool reads_shape = false;             // some value reads the tensor's shape (Op::Shape)
  // Whether the plan has row or column values or reads shapes (its chunks then hold whole rows; the
  // CPU backend interprets such plans, having no generated loop for them yet).
  bool matrix() const {
    return reads_shape || layout.row_reductions + layout.col_reductions + layout.row_values + layout.col_values > 0;
  }
  // A reduction of row or column values (a Sum over the tensor, taken by the Values step, no pass).
  bool is_value_reduction(NodeId reduction) const;
  // Where a row or column value (row_derived / col_derived) sits in its value table's entry.
  size_t line_value_index(NodeId node) const;
  Scope scope_of(size_t reduction) const { return reduction_scope(program.graph.node(reductions[reduction])); }
  // The index in `reductions` (and in the partials) of a reduction node.
  size_t reduction_index(NodeId node) const;
  // Uniform and tensor values a phase may use: those of lower levels (and all for the update phase).
  int value_level_limit(const ElementPhase& ph) const {
    return ph.kind == ElementPhase::Kind::Update ? ph.level : ph.level - 1;
  }
  // The tensor values of level <= limit, in graph order. per_matrix_only (matrix plans): those that
  // read a sum of row or column values, maybe through others (what entering another matrix of the
  // same tensor changes).
  std::vector<NodeId> tensor_value_nodes(int limit, bool per_matrix_only = false) const;
  // Whether a tensor with these state dtypes (one per state) runs `phases` as they are (true) or, for
  // the last reduce pass and the update, `recomputing` (false).
  bool runs_states_ahead(const std::vector<DType>& state_dtypes) const;
  // Whether phase i has a recomputing form (it is one of the last two phases of such a plan).
  bool has_recomputing_form(size_t i) const { return !recomputing.empty() && i + 2 >= phases.size(); }
  // The phase such a tensor runs as phase i.
  const ElementPhase& phase_for(size_t i, bool states_ahead) const;
  int max_level() const { return phases.empty() ? 0 : phases.back().level; }
  // Human-readable: phases, what each reads and writes, bytes per element for a storage dtype.
  std::string describe(DType storage = DType::f32) const;
};

// Runs the pass pipeline on the chain's program and plans it.
Plan make_plan(const Chain& chain, const Precision& precision = {});
Plan make_plan(Program program);

// Prints the IR one node per line ("%7 = mul %3, %5   ; element L0 exp_avg_new").
std::string print_ir(const Program& p, const std::vector<ValueKind>* kinds = nullptr);

}  // namespace optfuse
