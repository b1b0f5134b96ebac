#include "rules/suggest.h"

#include <algorithm>

namespace optfuse {

static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string suggestion(const std::string& name, const std::vector<std::string>& known) {
  size_t best = 3;
  std::string pick;
  for (const auto& k : known) {
    size_t d = edit_distance(name, k);
    if (d < best) {
      best = d;
      pick = k;
    }
  }
  return pick.empty() ? "" : " (did you mean '" + pick + "'?)";
}

std::string join_names(const std::vector<std::string>& names, size_t stride) {
  std::string out;
  for (size_t i = 0; i < names.size(); i += stride) out += (out.empty() ? "" : ", ") + names[i];
  return out;
}

}  // namespace optfuse
