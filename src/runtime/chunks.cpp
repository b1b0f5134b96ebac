#include "runtime/chunks.h"

#include "optfuse/error.h"

namespace optfuse {

std::vector<Chunk> build_chunks(const std::vector<TensorRef>& tensors, int32_t chunk_elems) {
  if (chunk_elems <= 0) throw Error("chunk size must be positive");
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    int64_t n = tensors[t].param.numel;
    for (int64_t b = 0; b < n; b += chunk_elems) {
      int64_t len = n - b < chunk_elems ? n - b : chunk_elems;
      chunks.push_back({b, static_cast<int32_t>(t), static_cast<int32_t>(len)});
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
