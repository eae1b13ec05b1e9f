// Eventually: waits (bounded) for a condition a daemon brings about in the background, such
// as a file a test pause point creates. It polls every 5 ms, so a test never sleeps longer
// than it must; it gives up after `limit` and returns the condition's last value.
#pragma once

#include <chrono>
#include <thread>

namespace ckpt::test {

template <typename F>
bool Eventually(F done, std::chrono::seconds limit = std::chrono::seconds(60)) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

}  // namespace ckpt::test
