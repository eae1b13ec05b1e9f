#include "daemon/base/throttled_log.h"

#include <spdlog/spdlog.h>

namespace ckpt {

void ThrottledLog::Warn(const std::string& line) {
  const auto now = std::chrono::steady_clock::now();
  std::uint64_t suppressed = 0;
  {
    MutexLock lock(mu_);
    if (last_ != std::chrono::steady_clock::time_point{} && now - last_ < every_) {
      ++suppressed_;
      return;
    }
    last_ = now;
    suppressed = suppressed_;
    suppressed_ = 0;
  }
  if (suppressed > 0) {
    spdlog::warn("{} (and {} more like it not logged in the last {} ms)", line, suppressed, every_.count());
  } else {
    spdlog::warn("{}", line);
  }
}

}  // namespace ckpt
