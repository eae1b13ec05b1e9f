// Latch: a one-shot gate. Wait blocks until some thread calls Open; after that, every Wait
// returns at once. The fake device uses it for the trainer's interprocess event and for
// "this has happened" signals a test waits on. Thread-safe.
#pragma once

#include <condition_variable>
#include <mutex>

namespace ckpt::test {

class Latch {
 public:
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace ckpt::test
