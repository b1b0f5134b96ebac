// The message of the optfuse::Error a call throws, or "<no error>": what the tests of error
// messages compare.
#pragma once
#include <functional>
#include <string>

#include "optfuse/error.h"

namespace optfuse::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace optfuse::testing
