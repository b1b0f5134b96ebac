// The step schedule: what one step does, in order, lowered from the plan's phases. Every backend
// executes it step by step; printing it (Plan::describe, `optfuse explain`) says exactly what a
// step costs. For a plan with reduce passes:
//
//   scalar 0 -> pass 0 (reduce) -> exchange 0 -> combine 0 -> scalar 1 -> pass 1 (update)
//
//   Scalar   uniform math per group (hyperparameters, step, bias corrections, values of the
//            reductions combined so far) into the derived area; before the update pass it also
//            decides skip and commits the step count
//   Pass     one launch over the tensor table (an element phase): the roles it reads and writes,
//            and, for a reduce pass, one partial sum per chunk of each reduction it produces
//   Exchange the hook point between a reduce pass and its combine: a sharded optimizer replaces
//            the per-chunk partials with every rank's, in global chunk order (Optimizer::set_exchange);
//            without an exchange it does nothing
//   Combine  per-chunk partials -> values of their scope, in chunk order (global: all chunks; per
//            tensor: the tensor's chunks; per column: the tensor's chunks' column partials), so every
//            scope is bitwise deterministic
//   Values   (matrix plans) before a pass: the row and column values it may read, and their per-tensor sums
//   Commit   (matrix plans) after the update pass: Rows and Cols states take their new values where
//            the step is not skipped
//
// The CUDA backend folds a Combine into the last block of the pass before it and a Scalar into
// the prologue of every block of the pass after it (one launch per pass); with an exchange set,
// a Combine is a launch of its own after the exchange.
#pragma once
#include <string>
#include <vector>

namespace optfuse {

struct Plan;

struct ScheduleStep {
  enum class Kind { Scalar, Values, Pass, Exchange, Combine, Commit };
  Kind kind = Kind::Pass;
  // Pass: the element phase it runs. Scalar: the phase whose uniform values it prepares.
  // Exchange, Combine: the reduce phase whose partial sums they handle.
  int phase = 0;
};

// The schedule of a plan (Plan::schedule holds it).
std::vector<ScheduleStep> make_schedule(const Plan& plan);
// One line per step, e.g. "pass 0: reduce (sum_of_squares) 4 B/element".
std::string describe_schedule(const Plan& plan);

}  // namespace optfuse
