#include "runtime/chunks.h"

#include <algorithm>
#include <climits>
#include <string>

#include "optfuse/error.h"
#include "runtime/matrix_tables.h"

namespace optfuse {

std::vector<Chunk> build_chunks(const std::vector<TensorRef>& tensors, int32_t chunk_elems, bool whole_rows,
                                int32_t max_rows) {
  if (chunk_elems <= 0) throw Error("chunk size must be positive");
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].param.numel;
    int64_t size = chunk_elems, span = n;  // chunks of `size` elements, restarting every `span`
    if (whole_rows) {
      const MatrixView v = matrix_view(tensors[t]);
      if (v.small_matrices()) {  // whole matrices
        size = v.matrix_rows * v.cols * std::max<int64_t>(1, chunk_elems / (v.matrix_rows * v.cols));
      } else {  // rows of one matrix: a chunk never spans two matrices of a batch
        int64_t rows = std::min(std::max<int64_t>(1, chunk_elems / v.cols), std::max<int64_t>(1, v.matrix_rows));
        if (max_rows > 0 && v.cols > 1) rows = std::min<int64_t>(rows, max_rows);
        size = v.cols * rows;
        span = v.matrix_rows * v.cols;
      }
      if (size > INT32_MAX) throw Error("tensor " + std::to_string(t) + ": a row of " + std::to_string(v.cols) +
                                        " columns is longer than a chunk can be (2^31 - 1 elements)");
    }
    for (int64_t m = 0; m < n; m += span)
      for (int64_t b = m; b < m + span && b < n; b += size) {
        const int64_t end = std::min(std::min(b + size, m + span), n);
        chunks.push_back({b, static_cast<int32_t>(t), static_cast<int32_t>(end - b)});
      }
  }
  return chunks;
}

std::vector<ChunkRange> chunk_ranges(size_t num_tensors, const std::vector<Chunk>& chunks) {
  std::vector<ChunkRange> out(num_tensors);
  for (size_t c = chunks.size(); c-- > 0;) {  // backwards: first ends at the lowest index
    ChunkRange& r = out[static_cast<size_t>(chunks[c].tensor)];
    r.first = static_cast<uint32_t>(c);
    ++r.count;
  }
  return out;
}

}  // namespace optfuse
