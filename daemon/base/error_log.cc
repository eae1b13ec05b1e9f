#include "daemon/base/error_log.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace ckpt {

void ErrorLog::Record(const std::string& message) {
  spdlog::error("{}", message);
  const auto now = std::chrono::system_clock::now();
  MutexLock lock(mu_);
  auto it =
      std::find_if(errors_.begin(), errors_.end(), [&](const Entry& e) { return e.message == message; });
  Entry entry{message, 0, now, now};
  if (it != errors_.end()) {
    entry = std::move(*it);
    errors_.erase(it);
  }
  ++entry.count;
  entry.last = now;
  errors_.push_back(std::move(entry));
  while (errors_.size() > kKept) errors_.pop_front();
}

std::vector<std::string> ErrorLog::Recent() const {
  MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const Entry& e : errors_) out.push_back(e.message);
  return out;
}

std::vector<ErrorLog::Entry> ErrorLog::Entries() const {
  MutexLock lock(mu_);
  return {errors_.begin(), errors_.end()};
}

}  // namespace ckpt
