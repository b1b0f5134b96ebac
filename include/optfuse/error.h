// optfuse::Error: the one exception type the library throws for bad input or an unusable backend.
// Messages name what was wrong and, where there is one, the position or the name involved; a call
// that throws has changed nothing (state, tensors and scalars are left as they were).
#pragma once
#include <stdexcept>
#include <string>

namespace optfuse {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Backend unavailable at run time (no GPU, no driver, no NVRTC, no host compiler): a distinct type so
// callers and tests can fall back or skip with the reason.
class BackendUnavailable : public Error {
 public:
  explicit BackendUnavailable(const std::string& what) : Error(what) {}
};

}  // namespace optfuse
