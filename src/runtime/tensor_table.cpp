#include "runtime/tensor_table.h"

namespace optfuse {

std::vector<uint64_t> build_tensor_table(const std::vector<TensorRef>& tensors, int num_states,
                                         const std::vector<Chunk>& chunks) {
  size_t roles = 2 + static_cast<size_t>(num_states);
  std::vector<uint32_t> first(tensors.size(), 0), count(tensors.size(), 0);
  for (size_t c = chunks.size(); c-- > 0;) {  // backwards: first ends at the lowest index
    size_t t = static_cast<size_t>(chunks[c].tensor);
    first[t] = static_cast<uint32_t>(c);
    ++count[t];
  }
  std::vector<uint64_t> words;
  words.reserve(tensors.size() * (roles + kTensorTableExtraWords));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRef& t = tensors[i];
    words.push_back(reinterpret_cast<uint64_t>(t.param.data));
    words.push_back(reinterpret_cast<uint64_t>(t.grad.data));
    for (int s = 0; s < num_states; ++s) words.push_back(reinterpret_cast<uint64_t>(t.states[static_cast<size_t>(s)].data));
    words.push_back(static_cast<uint64_t>(t.param.numel));
    words.push_back(static_cast<uint64_t>(static_cast<uint32_t>(t.group)) |
                    (static_cast<uint64_t>(static_cast<uint8_t>(t.param.dtype)) << 32));
    words.push_back(static_cast<uint64_t>(first[i]) | (static_cast<uint64_t>(count[i]) << 32));
  }
  return words;
}

}  // namespace optfuse
