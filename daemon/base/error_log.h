// ErrorLog: the newest errors of background work (a failed flush, promotion or commit, a
// tier copy that failed verification), logged and kept for the Status report, so that no
// failure is silent even when no trainer call is there to carry it.
//
// A message recorded again while it is still kept is folded into its entry (a count and the
// time it was last seen, the entry moved to the newest place) rather than kept twice: a
// restore that meets the same unreachable peer for every shard it lists says so once, with
// how often. Only identical messages fold; each occurrence is still logged. Thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "common/mutex.h"

namespace ckpt {

class ErrorLog {
 public:
  static constexpr std::size_t kKept = 32;  // distinct messages kept
  struct Entry {
    std::string message;
    std::uint64_t count = 0;  // times recorded while kept
    std::chrono::system_clock::time_point first, last;
  };
  // Logs `message` and keeps it (folded into its entry if it is kept already).
  void Record(const std::string& message) EXCLUDES(mu_);
  // The messages kept, newest last, each once.
  std::vector<std::string> Recent() const EXCLUDES(mu_);
  // The same with their counts and times.
  std::vector<Entry> Entries() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::deque<Entry> errors_ GUARDED_BY(mu_);
};

}  // namespace ckpt
