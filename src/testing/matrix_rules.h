// Rules with row and column scopes shared by the CPU and CUDA tests of matrix plans.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::testing {

// Maxima of abs over rows and over columns (as Rows and Cols states) and over a tensor's row values:
// update g * (0.1 + max_r rows) / (1 + rows * cols). Every fold of a max of abs, on every backend.
Rule row_and_column_max();

// cols <- column sums of g^2; update g * (the sum of cols over the tensor, per matrix of a batch):
// a per-tensor sum of column values.
Rule sum_of_columns();

// Rows and Cols states of g^2's row and column sums; update
// g * (sum(cols) / (1 + sum(rows)) + 0.1 * max|cols| / (1 + max|cols|)), sums and max over the tensor
// (per matrix of a batch): sums of row and of column values and a max of column values in one step,
// the update of the order of g.
Rule row_and_column_value_sums();

}  // namespace optfuse::testing
