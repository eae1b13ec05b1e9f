// RunParallel: runs `body` on up to n-1 new threads, then on the calling one. The bodies
// claim their work from shared counters, so it is all done even when fewer threads could be
// started (thread creation failing is not an error).
#pragma once

#include <functional>
#include <system_error>
#include <thread>
#include <vector>

namespace ckpt {

inline void RunParallel(unsigned n, const std::function<void()>& body) {
  std::vector<std::thread> threads;
  for (unsigned w = 1; w < n; ++w) {
    try {
      threads.emplace_back(body);
    } catch (const std::system_error&) {
      break;
    }
  }
  body();
  for (auto& t : threads) t.join();
}

}  // namespace ckpt
