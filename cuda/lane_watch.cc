#include "cuda/lane_watch.h"

#include <utility>

namespace ckpt::cuda {

LaneWatch::Id LaneWatch::Add(int device, std::function<bool()> idle) {
  MutexLock lock(mu_);
  const Id id = next_++;
  lanes_[id] = Lane{device, std::move(idle), nullptr};
  return id;
}

void LaneWatch::Remove(Id lane) {
  MutexLock lock(mu_);
  lanes_.erase(lane);
}

void LaneWatch::Gated(Id lane, std::shared_ptr<const std::atomic<bool>> trainer_gone) {
  MutexLock lock(mu_);
  if (auto it = lanes_.find(lane); it != lanes_.end()) it->second.trainer_gone = std::move(trainer_gone);
}

void LaneWatch::Flowing(Id lane) {
  MutexLock lock(mu_);
  if (auto it = lanes_.find(lane); it != lanes_.end()) it->second.trainer_gone.reset();
}

bool LaneWatch::Abandoned(int device) const {
  MutexLock lock(mu_);
  for (const auto& [id, lane] : lanes_) {
    if (device >= 0 && lane.device != device) continue;
    if (lane.trainer_gone && lane.trainer_gone->load() && !lane.idle()) return true;
  }
  return false;
}

}  // namespace ckpt::cuda
