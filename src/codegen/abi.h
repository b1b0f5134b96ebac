// The data layout shared by the runtime and generated code, printed once for every dialect, so the
// host side (runtime/tensor_table.h, runtime/chunks.h, runtime/executor.h) and the structs the
// generated code reads cannot drift apart: the static_asserts there pin the host side's sizes.
//   OfTensor   one tensor-table row: a pointer per role (param, grad, each state), the element
//              count, the group, the storage dtype, and the tensor's range in the chunk list
//   OfChunk    one chunk: first element within its tensor, the tensor, the element count
//   OfHyperSource  where a group's hyperparameter is read from (HyperSource)
#pragma once
#include <string>

namespace optfuse {

// Needs OF_ROLES defined before it.
std::string abi_source();

}  // namespace optfuse
