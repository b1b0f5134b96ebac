// Skips a CUDA test with the reason when what it needs is missing here (CI has NVRTC but no GPU).
// Both macros expect `namespace cu = optfuse::cuda;` in scope.
#pragma once
#include <string>

#include <gtest/gtest.h>

#include "runtime/cuda_api.h"

#define REQUIRE_NVRTC()                                          \
  do {                                                           \
    std::string why_;                                            \
    if (!cu::nvrtc_available(&why_)) GTEST_SKIP() << why_;       \
  } while (0)

#define REQUIRE_GPU()                                            \
  do {                                                           \
    std::string why_;                                            \
    if (!cu::driver_available(&why_)) GTEST_SKIP() << why_;      \
    if (!cu::nvrtc_available(&why_)) GTEST_SKIP() << why_;       \
  } while (0)
