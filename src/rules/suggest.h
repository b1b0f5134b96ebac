// "Did you mean" suggestions for misspelled names in errors.
#pragma once
#include <string>
#include <vector>

namespace optfuse {

// " (did you mean 'lr'?)" for the closest name within edit distance 2, else "".
std::string suggestion(const std::string& name, const std::vector<std::string>& known);
// "a, b, c": every `stride`-th name of `names`, starting at the first.
std::string join_names(const std::vector<std::string>& names, size_t stride);

}  // namespace optfuse
