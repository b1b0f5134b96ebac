// The tensor table generated code walks: per tensor, one pointer per role (param, grad, each
// state), the element count, the group, the storage variant (codegen/abi.h), the tensor's chunks and
// its stochastic-rounding stream. Built once per tensor set as plain 64-bit words so that host and
// device copies have the same bytes:
//   word[0..R)  role pointers   word[R]  numel   word[R+1]  group | variant << 32
//   word[R+2]   first_chunk | num_chunks << 32   (its chunks are contiguous in the chunk list)
//   word[R+3]   rng_key         word[R+4]  rng_offset
// The generated struct OfTensor (codegen/abi.cpp) matches.
#pragma once
#include <cstdint>
#include <vector>

#include "optfuse/optimizer.h"
#include "runtime/chunks.h"

namespace optfuse {

constexpr size_t kTensorTableExtraWords = 5;  // words after the role pointers

// `ranges` (chunk_ranges) is computed once per tensor set: rebuilding the table for new gradient
// pointers (every step of a zero_grad loop) stays linear in the tensors, not the chunks.
// `variants[t]`: tensor t's index in the compiled variant list (assign_variants).
std::vector<uint64_t> build_tensor_table(const std::vector<TensorRef>& tensors, int num_states,
                                         const std::vector<ChunkRange>& ranges, const std::vector<int>& variants);

}  // namespace optfuse
