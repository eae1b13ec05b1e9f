#include "daemon/replication/progress_watch.h"

namespace ckpt {

ProgressWatch::ProgressWatch(std::chrono::milliseconds limit, std::function<void()> give_up)
    : limit_(limit), give_up_(std::move(give_up)) {
  {
    MutexLock lock(mu_);
    last_ = std::chrono::steady_clock::now();
  }
  thread_ = std::thread([this] { Watch(); });
}

ProgressWatch::~ProgressWatch() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  changed_.SignalAll();
  thread_.join();
}

void ProgressWatch::Progress() {
  MutexLock lock(mu_);
  last_ = std::chrono::steady_clock::now();
}

bool ProgressWatch::fired() {
  MutexLock lock(mu_);
  return fired_;
}

void ProgressWatch::Watch() {
  MutexLock lock(mu_);
  while (!stopping_) {
    const auto deadline = last_ + limit_;
    if (std::chrono::steady_clock::now() >= deadline) {
      fired_ = true;
      // Under the lock: the destructor, which waits for this thread, cannot have returned,
      // so the call give_up cancels still exists.
      give_up_();
      return;
    }
    changed_.WaitUntil(mu_, deadline);
  }
}

}  // namespace ckpt
