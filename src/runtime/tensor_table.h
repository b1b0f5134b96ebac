// The tensor table generated code walks: per tensor, one pointer per role (param, grad, each
// state), the element count, the group and the storage dtype. Built once per tensor set as plain
// 64-bit words so that host and device copies have the same bytes:
//   word[0..R)  role pointers      word[R]  numel      word[R+1]  group | dtype << 32
// The generated struct OfTensor { void* ptr[R]; long long numel; int group; int dtype; } matches.
#pragma once
#include <cstdint>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse {

std::vector<uint64_t> build_tensor_table(const std::vector<TensorRef>& tensors, int num_states);

}  // namespace optfuse
