#include "runtime/tensor_table.h"

#include "optfuse/error.h"

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

void patch_grad_words(std::vector<uint64_t>& words, const std::vector<TensorRef>& tensors, int num_states) {
  const size_t row = tensor_row_words(num_states), tail = grad_tail_word(tensors.size(), num_states);
  if (words.size() != tail + tensors.size()) throw Error("patch_grad_words: the table is of another tensor set");
  for (size_t t = 0; t < tensors.size(); ++t)
    words[t * row + kGradWord] = words[tail + t] = reinterpret_cast<uint64_t>(tensors[t].grad.data);
}

}  // namespace optfuse
