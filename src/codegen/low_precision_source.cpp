// The text of low_precision_code.h for the generated kernels' prelude. OF_FN stays as written
// (it is not defined here), so each dialect's own qualifier applies.
#include "codegen/low_precision_source.h"

#include "ir/low_precision_code.h"

#define OF_STRINGIFY_ARGS(...) #__VA_ARGS__
#define OF_STRINGIFY(...) OF_STRINGIFY_ARGS(__VA_ARGS__)

namespace optfuse {

std::string low_precision_source() {
  return "\n// Low-precision storage: stochastic rounding, master-weight remainders, q8 blocks (src/ir/low_precision_code.h)\n" +
         std::string(OF_STRINGIFY(OF_LOW_PRECISION_CODE)) + "\n";
}

}  // namespace optfuse
