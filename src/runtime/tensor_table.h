// The tensor table generated code walks: per tensor, one pointer per role (param, grad, each
// state), the element count, the group, the storage variant (codegen/abi.h), the tensor's chunks and
// its stochastic-rounding stream. Built once per tensor set as plain 64-bit words so that host and
// device copies have the same bytes:
//   word[0..R)  role pointers   word[R]  numel   word[R+1]  group | variant << 32
//   word[R+2]   first_chunk | num_chunks << 32   (its chunks are contiguous in the chunk list)
//   word[R+3]   rng_key         word[R+4]  rng_offset
// The generated struct OfTensor (codegen/abi.cpp) matches. After the T rows, a tail of T words: each
// tensor's gradient pointer again, densely. The CUDA kernels read gradients from the tail, so the
// step of a loop that gives new gradient tensors every step (zero_grad, backward) uploads 8 bytes
// per tensor rather than the whole table; host drivers read word[1].
#pragma once
#include <cstdint>
#include <vector>

#include "optfuse/optimizer.h"
#include "runtime/chunks.h"

namespace optfuse {

constexpr size_t kTensorTableExtraWords = 5;  // words after the role pointers
constexpr size_t kGradWord = 1;                // the gradient pointer's word in a row


// Words of one tensor's row: a pointer per role (param, grad, each state), then the extra words.
inline size_t tensor_row_words(int num_states) { return 2 + static_cast<size_t>(num_states) + kTensorTableExtraWords; }

// Index of the first word of the gradient-pointer tail (after every tensor's row).
inline size_t grad_tail_word(size_t num_tensors, int num_states) { return num_tensors * tensor_row_words(num_states); }

// `ranges` (chunk_ranges) is computed once per tensor set: rebuilding the table for new gradient
// pointers (every step of a zero_grad loop) stays linear in the tensors, not the chunks.
// `variants[t]`: tensor t's index in the compiled variant list (assign_variants).
std::vector<uint64_t> build_tensor_table(const std::vector<TensorRef>& tensors, int num_states,
                                         const std::vector<ChunkRange>& ranges, const std::vector<int>& variants);

// Rewrites the gradient words (in each row and in the tail) of a table build_tensor_table made for
// the same tensor set: the per-step update of a loop that gives new gradient tensors every step.
void patch_grad_words(std::vector<uint64_t>& words, const std::vector<TensorRef>& tensors, int num_states);

}  // namespace optfuse
