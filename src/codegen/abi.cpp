#include "codegen/abi.h"

namespace optfuse {

std::string abi_source() {
  return R"(
// Shared with the runtime (codegen/abi.h): tensor-table rows are plain 64-bit words.
struct OfTensor { void* ptr[OF_ROLES]; long long numel; int group; int dtype; int first_chunk; int num_chunks; };
struct OfChunk { long long begin; int tensor; int length; };
// Where a group's hyperparameter is read from: ptr == 0: the table; else a float32 (type 0) or
// float64 (type 1) scalar (HyperSource in runtime/executor.h).
struct OfHyperSource { unsigned long long ptr; int type; int pad; };
)";
}

}  // namespace optfuse
