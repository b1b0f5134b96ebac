// Rules with row and column scopes shared by the CPU and CUDA tests of matrix plans.
#pragma once
#include "optfuse/rule.h"

namespace optfuse::testing {

// Maxima of abs over rows and over columns (as Rows and Cols states) and over a tensor's row values:
// update g * (0.1 + max_r rows) / (1 + rows * cols). Every fold of a max of abs, on every backend.
Rule row_and_column_max();

}  // namespace optfuse::testing
