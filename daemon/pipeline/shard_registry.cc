#include "daemon/pipeline/shard_registry.h"

#include <algorithm>

namespace ckpt {

std::shared_ptr<ShardJob> ShardRegistry::Add(const std::shared_ptr<ShardJob>& shard) {
  MutexLock lock(mu_);
  // Versions that never commit leave entries whose shards are all gone: drop them.
  for (auto it = by_version_.begin(); it != by_version_.end();) {
    auto& weak = it->second;
    weak.erase(std::remove_if(weak.begin(), weak.end(), [](const auto& w) { return w.expired(); }),
               weak.end());
    it = weak.empty() ? by_version_.erase(it) : std::next(it);
  }
  by_version_[{shard->meta().job, shard->meta().version}].push_back(shard);
  recent_.push_back(shard);
  if (recent_.size() <= kRecentShards) return nullptr;
  std::shared_ptr<ShardJob> dropped = std::move(recent_.front());
  recent_.pop_front();
  return dropped;
}

std::vector<std::shared_ptr<ShardJob>> ShardRegistry::TakeVersion(const std::string& job,
                                                                  std::uint64_t version) {
  std::vector<std::shared_ptr<ShardJob>> out;
  MutexLock lock(mu_);
  auto it = by_version_.find({job, version});
  if (it == by_version_.end()) return out;
  for (const auto& w : it->second) {
    if (auto p = w.lock()) out.push_back(std::move(p));
  }
  by_version_.erase(it);
  return out;
}

std::vector<std::shared_ptr<ShardJob>> ShardRegistry::Version(const std::string& job,
                                                              std::uint64_t version) const {
  std::vector<std::shared_ptr<ShardJob>> out;
  MutexLock lock(mu_);
  auto it = by_version_.find({job, version});
  if (it == by_version_.end()) return out;
  for (const auto& w : it->second) {
    if (auto p = w.lock()) out.push_back(std::move(p));
  }
  return out;
}

std::vector<std::shared_ptr<ShardJob>> ShardRegistry::Recent() const {
  MutexLock lock(mu_);
  return {recent_.begin(), recent_.end()};
}

std::vector<std::shared_ptr<ShardJob>> ShardRegistry::Uncaptured(const std::string& job,
                                                                 const std::string& queue) const {
  std::vector<std::shared_ptr<ShardJob>> out;
  MutexLock lock(mu_);
  for (const auto& [key, shards] : by_version_) {
    if (key.first != job) continue;
    for (const auto& weak : shards) {
      auto shard = weak.lock();
      if (shard && shard->copy_queue() == queue && shard->level() < Level::kCaptured)
        out.push_back(std::move(shard));
    }
  }
  return out;
}

std::vector<std::shared_ptr<ShardJob>> ShardRegistry::Unsealed(const std::string& job,
                                                               const std::string& queue) const {
  std::vector<std::shared_ptr<ShardJob>> out;
  MutexLock lock(mu_);
  for (const auto& [key, shards] : by_version_) {
    if (key.first != job) continue;
    for (const auto& weak : shards) {
      auto shard = weak.lock();
      if (shard && shard->copy_queue() == queue && shard->sealed_registration() && !shard->sealed() &&
          !shard->failed())
        out.push_back(std::move(shard));
    }
  }
  return out;
}

Status ShardRegistry::WaitRankNewestSettled(const std::string& job, std::uint32_t rank,
                                            const CancelCheck& cancelled,
                                            const std::function<void(const ShardMeta&)>& waiting_for) const {
  std::vector<std::shared_ptr<ShardJob>> newest_first;
  {
    MutexLock lock(mu_);
    // Admission order, not version order: after a rollback, higher numbers may be older.
    for (auto it = recent_.rbegin(); it != recent_.rend(); ++it) {
      if ((*it)->meta().job == job && (*it)->meta().rank == rank) newest_first.push_back(*it);
    }
  }
  for (const auto& shard : newest_first) {
    if (waiting_for) waiting_for(shard->meta());
    // The shard's own outcome (a failure) is its trainer's to hear, not this caller's.
    Status st = WaitInSlices(std::chrono::steady_clock::time_point::max(), cancelled,
                             [&](auto slice_end) { return shard->WaitFor(Level::kPersisted, slice_end); });
    if (st.code() == StatusCode::kCancelled) return st;
    if (st.ok()) return Status::Ok();  // what a restore can get; older ones are superseded by it
  }
  return Status::Ok();
}

}  // namespace ckpt
