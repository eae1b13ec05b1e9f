// Small helpers shared by the example trainers: percentiles of samples and durations in ms.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

namespace ckpt::examples {

// The p-th percentile (0-100, nearest rank) of `v`; 0 for no samples.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

inline double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace ckpt::examples
