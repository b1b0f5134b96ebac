#include "runtime/tensor_table.h"

namespace optfuse {

std::vector<uint64_t> build_tensor_table(const std::vector<TensorRef>& tensors, int num_states,
                                         const std::vector<ChunkRange>& ranges, const std::vector<int>& variants) {
  std::vector<uint64_t> words;
  words.reserve(tensors.size() * (tensor_row_words(num_states) + 1));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRef& t = tensors[i];
    words.push_back(reinterpret_cast<uint64_t>(t.param.data));
    words.push_back(reinterpret_cast<uint64_t>(t.grad.data));
    for (int s = 0; s < num_states; ++s) words.push_back(reinterpret_cast<uint64_t>(t.states[static_cast<size_t>(s)].data));
    words.push_back(static_cast<uint64_t>(t.param.numel));
    words.push_back(static_cast<uint64_t>(static_cast<uint32_t>(t.group)) |
                    (static_cast<uint64_t>(static_cast<uint32_t>(variants.at(i))) << 32));
    words.push_back(static_cast<uint64_t>(ranges.at(i).first) | (static_cast<uint64_t>(ranges[i].count) << 32));
    words.push_back(t.rng_key);
    words.push_back(static_cast<uint64_t>(t.rng_offset));
  }
  for (const TensorRef& t : tensors) words.push_back(reinterpret_cast<uint64_t>(t.grad.data));
  return words;
}

}  // namespace optfuse
