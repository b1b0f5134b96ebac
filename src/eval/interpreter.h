// The plan interpreted on the host: the reference evaluator (element math in float64) and the CPU
// fallback when no compiler is available (element math in float32, the same rounding as the
// generated code). Also the scalar phase, which the reference and CPU backends share.
#pragma once
#include <array>
#include <functional>
#include <vector>

#include "optfuse/optimizer.h"
#include "runtime/chunks.h"
#include "runtime/matrix_tables.h"

namespace optfuse {

// The schedule's Combine step for reduce phase `phase`: combines the per-chunk partial sums of the
// reductions it produced in chunk order, global ones over every column of their row into the table's
// reduction area, per-tensor ones over the tensor's span of columns into
// tensor_reductions[tensor][slot]. row(r) is reduction r's partials; columns are chunks: the
// executor's own (spans from chunk_ranges) or, for a sharded step, every rank's in global order.
// Matrix plans (m): column reductions are combined from m's per-chunk column partials, in chunk
// order; row reductions need no combining (a chunk holds whole rows).
void combine_partials(const Plan& plan, size_t phase, const std::function<const double*(size_t)>& row,
                      const std::vector<ChunkRange>& spans, int64_t columns, double* table,
                      std::vector<double>& tensor_reductions, MatrixTables* m = nullptr);

// Scalar phase before element phase `phase_index` of the plan: evaluates uniform values for every
// group in float64 into the derived area (reductions already combined). Before the update phase it
// also decides skip per group and, where not skipped, commits the step count and the uniform states
// (the values every uniform read of this step saw are the old ones).
void run_scalar_phase(const Plan& plan, size_t phase_index, double* table, int groups);

// One tensor's values (ValueKind::Tensor) `nodes` (Plan::tensor_value_nodes, found once), float64,
// into val[node]: from its group's derived row and its row of tensor_reductions. What generated
// code does per chunk.
// shape: the tensor's numel, rows (of one matrix), columns and whether it has a matrix view
// (Op::Shape). sums_row (matrix plans): the sums of row and column values of the matrix of the
// view the values are for (MatrixTables::matrix_sums); value reductions are read there.
void eval_tensor_values(const Plan& plan, const std::vector<NodeId>& nodes, const double* derived_row,
                        const double* reductions_row, const double* shape, std::vector<double>& val,
                        const double* sums_row = nullptr);
// Op::Shape's values for a tensor.
std::array<double, 4> shape_values(const TensorRef& t);

// One element phase over chunks [first, last) of `chunks`. For a reduce phase, writes one partial
// per reduction of this phase per chunk into partials[reduction slot][chunk]. T = double is the
// reference evaluator; T = float mirrors generated code. Matrix plans (m): elements read their
// row's and column's values from m; row reductions go to m's row table (a chunk holds whole rows),
// column reductions to the chunk's column partials. A tensor runs plan.phase_for(phase, ...): the
// recomputing forms where its states written ahead are not float32.
template <class T>
void run_element_phase(const Plan& plan, size_t phase, const std::vector<TensorRef>& tensors,
                       const std::vector<Chunk>& chunks, size_t first, size_t last, const double* table,
                       int groups, const std::vector<double>& tensor_reductions,
                       std::vector<std::vector<double>>& partials, MatrixTables* m = nullptr);

// The schedule's Values step before pass `phase` of a matrix plan: every tensor's row and column
// values of the levels the pass may read, into m's value tables, then each matrix's sums of row
// or column values of those levels into m.matrix_sums, matrix by matrix. Math in T, as
// run_element_phase.
template <class T>
void run_values_step(const Plan& plan, size_t phase, const std::vector<TensorRef>& tensors, const double* table,
                     int groups, std::vector<double>& tensor_reductions, MatrixTables& m);

// The Commit step: Rows and Cols states of tensors whose group did not skip take their new values.
void commit_matrix_states(const Plan& plan, const std::vector<TensorRef>& tensors, const double* table, int groups,
                          const MatrixTables& m);

// Writes the step's global scalars (grad_scale, found_inf; host pointers or defaults 1 and 0).
void set_globals(double* table, const StepInputs& in);

}  // namespace optfuse
