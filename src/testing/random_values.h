// Seeded standard-normal float32 values and the largest entry / difference of two such arrays:
// what the matrix-phase tests (CPU and CUDA) build their matrices from and compare with.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace optfuse::testing {

inline std::vector<float> normal_values(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

inline double largest_abs(const std::vector<float>& a) {
  double w = 0;
  for (float x : a) w = std::max(w, double(std::fabs(x)));
  return w;
}

inline double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double w = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) w = std::max(w, double(std::fabs(a[i] - b[i])));
  return w;
}

}  // namespace optfuse::testing
