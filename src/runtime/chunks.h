// Work decomposition shared by the backends: every tensor is cut into chunks of a fixed number of
// elements (the last chunk of a tensor may be shorter). The list is built once per tensor set.
// Because chunk boundaries depend only on the tensor sizes and the chunk size, never on thread or
// block counts, per-chunk partial sums combined in chunk order give bitwise-deterministic
// reductions.
#pragma once
#include <cstdint>
#include <vector>

#include "optfuse/optimizer.h"

namespace optfuse {

struct Chunk {
  int64_t begin;   // first element within the tensor
  int32_t tensor;  // index into the tensor table
  int32_t length;  // elements in this chunk (> 0)
};
static_assert(sizeof(Chunk) == 16, "Chunk is shared with generated code: keep it 16 bytes");

// whole_rows (matrix plans): every chunk holds whole rows of one matrix of its tensor's matrix view
// (TensorRef::cols, matrix_rows): max(1, chunk_elems / cols) of them (at most a matrix's), so a row
// longer than chunk_elems is a chunk, and every matrix of a batch has the same number of chunks; or,
// for a batch of small matrices (MatrixView::small_matrices), whole matrices, chunk_elems / (R x C) of them;
// at most max_rows (> 0) where the view has more than one column (the CUDA driver keeps a chunk's
// row sums in shared memory).
std::vector<Chunk> build_chunks(const std::vector<TensorRef>& tensors, int32_t chunk_elems, bool whole_rows = false,
                                int32_t max_rows = 0);

// Each tensor's chunks are contiguous in the list: where they start and how many there are.
struct ChunkRange {
  uint32_t first = 0, count = 0;
};
std::vector<ChunkRange> chunk_ranges(size_t num_tensors, const std::vector<Chunk>& chunks);

}  // namespace optfuse
