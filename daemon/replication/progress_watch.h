// ProgressWatch: gives up a transfer that stops moving. A peer (or whatever listens on its
// address) that sends a shard's header and then nothing, or takes a replica and then reads no
// more, would otherwise hold the caller until the call's deadline (minutes): a trainer's
// restore waits on it. The caller reports each piece that moves (Progress); once `limit`
// passes without one, the watch calls `give_up` (which cancels the call: the blocked read or
// write returns) once. One thread per watch, for one call's lifetime. Thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

#include "common/mutex.h"

namespace ckpt {

class ProgressWatch {
 public:
  ProgressWatch(std::chrono::milliseconds limit, std::function<void()> give_up);
  // Stops watching (give_up is not called after it returns).
  ~ProgressWatch();
  ProgressWatch(const ProgressWatch&) = delete;
  ProgressWatch& operator=(const ProgressWatch&) = delete;

  // A piece moved: the limit counts again from now.
  void Progress() EXCLUDES(mu_);
  // Whether the watch gave the transfer up.
  bool fired() EXCLUDES(mu_);
  std::chrono::milliseconds limit() const { return limit_; }

 private:
  void Watch() EXCLUDES(mu_);

  const std::chrono::milliseconds limit_;
  const std::function<void()> give_up_;
  Mutex mu_;
  CondVar changed_;
  std::chrono::steady_clock::time_point last_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool fired_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ckpt
