// ThrottledLog: warnings about a state that can last or that someone else controls (refused
// connections, refused or unproven peer calls), at most one per interval, each with the
// number suppressed since the last: a flood of bad connections or calls cannot fill the log
// or cost the daemon more than counting them. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/mutex.h"

namespace ckpt {

class ThrottledLog {
 public:
  explicit ThrottledLog(std::chrono::milliseconds every = std::chrono::seconds(1)) : every_(every) {}

  // Logs `line` at warning level, unless a line was logged less than the interval ago.
  void Warn(const std::string& line) EXCLUDES(mu_);

 private:
  const std::chrono::milliseconds every_;
  Mutex mu_;
  std::chrono::steady_clock::time_point last_ GUARDED_BY(mu_){};
  std::uint64_t suppressed_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
