// ErrorLog: the newest errors of background work (a failed flush, promotion or commit, a
// tier copy that failed verification), logged once and kept for the Status report, so that
// no failure is silent even when no trainer call is there to carry it. Thread-safe.
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <vector>

#include "common/mutex.h"

namespace ckpt {

class ErrorLog {
 public:
  static constexpr std::size_t kKept = 32;
  // Logs `message` and keeps it.
  void Record(const std::string& message) EXCLUDES(mu_);
  std::vector<std::string> Recent() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::deque<std::string> errors_ GUARDED_BY(mu_);
};

}  // namespace ckpt
