// LaneWatch: which of the daemon's copy lanes wait on an interprocess event of a trainer
// that exited, by device. The DeviceReleaser asks it before every close or unpin: while
// such a lane is pending on a device, a close there may synchronise behind it for ever.
//
// A lane is added when it is made and removed when it is destroyed. Gated() says the lane
// now waits on an event of a trainer (the flag turns true when that trainer exits:
// DeviceBackend::ReleaseClient); Flowing() says a copy queued after the gate completed,
// so the event fired. A lane is abandoned while it is gated, its trainer has exited and it
// is not idle (`idle` is asked under the watch's lock; it must not block: cudaStreamQuery).
// Lanes the engine leaves behind at shutdown are never removed, and stay abandoned.
//
// Thread-safety: all members are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "common/mutex.h"

namespace ckpt::cuda {

class LaneWatch {
 public:
  using Id = std::uint64_t;

  Id Add(int device, std::function<bool()> idle) EXCLUDES(mu_);
  void Remove(Id lane) EXCLUDES(mu_);
  void Gated(Id lane, std::shared_ptr<const std::atomic<bool>> trainer_gone) EXCLUDES(mu_);
  void Flowing(Id lane) EXCLUDES(mu_);
  // True while a lane on `device` (-1: on any device) is abandoned.
  bool Abandoned(int device) const EXCLUDES(mu_);

 private:
  struct Lane {
    int device = -1;
    std::function<bool()> idle;
    std::shared_ptr<const std::atomic<bool>> trainer_gone;  // null: not gated
  };
  mutable Mutex mu_;
  std::map<Id, Lane> lanes_ GUARDED_BY(mu_);
  Id next_ GUARDED_BY(mu_) = 1;
};

}  // namespace ckpt::cuda
