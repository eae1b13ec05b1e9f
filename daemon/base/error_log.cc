#include "daemon/base/error_log.h"

#include <spdlog/spdlog.h>

namespace ckpt {

void ErrorLog::Record(const std::string& message) {
  spdlog::error("{}", message);
  MutexLock lock(mu_);
  errors_.push_back(message);
  while (errors_.size() > kKept) errors_.pop_front();
}

std::vector<std::string> ErrorLog::Recent() const {
  MutexLock lock(mu_);
  return {errors_.begin(), errors_.end()};
}

}  // namespace ckpt
