// The shared low-precision helpers (src/ir/low_precision_code.h) as prelude text; needs the common
// prelude's conversions before it.
#pragma once
#include <string>

namespace optfuse {

std::string low_precision_source();

}  // namespace optfuse
