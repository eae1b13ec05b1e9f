// ShardRegistry: the shards this daemon has in flight or finished recently, found by the
// stages that act on more than one shard at a time. The commit tracker takes every shard
// of a (job, version) to raise them to committed (or fail them) together; sessions wait for
// a rank's shards to settle before a new registration or a restore, and give up the GPU
// shards of a trainer that exited; the status report lists the recent ones. Holds the
// newest kRecentShards strongly and the rest of each version weakly, so shards are freed
// once nothing else needs them. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cancellable_wait.h"
#include "common/mutex.h"
#include "daemon/pipeline/shard_job.h"

namespace ckpt {

class ShardRegistry {
 public:
  static constexpr std::size_t kRecentShards = 64;

  // A shard was admitted (before it is queued for copying). Returns the shard it no longer
  // holds strongly (null if none), often the last reference to it: the caller hands it to
  // the copy thread (ShardJob::Retire), so that the Snapshot call does not free thousands
  // of items.
  [[nodiscard]] std::shared_ptr<ShardJob> Add(const std::shared_ptr<ShardJob>& shard) EXCLUDES(mu_);
  // Removes and returns the live shards of (job, version): the caller commits or fails them.
  std::vector<std::shared_ptr<ShardJob>> TakeVersion(const std::string& job, std::uint64_t version)
      EXCLUDES(mu_);
  // The live shards of (job, version), left in place: the commit tracker writes a daemon's
  // marker of a version once none of them is still on its way.
  std::vector<std::shared_ptr<ShardJob>> Version(const std::string& job, std::uint64_t version) const
      EXCLUDES(mu_);
  // The newest shards, oldest first (in flight and recently done).
  std::vector<std::shared_ptr<ShardJob>> Recent() const EXCLUDES(mu_);
  // Shards of `job` from copy queue `queue` (one registration) not yet captured.
  std::vector<std::shared_ptr<ShardJob>> Uncaptured(const std::string& job, const std::string& queue) const
      EXCLUDES(mu_);
  // Shards of `job` from copy queue `queue` of a sealed registration that are neither
  // sealed nor failed (aborted included).
  std::vector<std::shared_ptr<ShardJob>> Unsealed(const std::string& job, const std::string& queue) const
      EXCLUDES(mu_);
  // Blocks until the newest recent shard of (job, rank) that does not fail is persisted:
  // waits for the newest admitted one, and only if it fails for the one before, and so on;
  // never for shards older than one that made it. kCancelled if `cancelled` turns true
  // meanwhile.
  // `waiting_for` (may be empty) hears of each shard before it is waited for.
  Status WaitRankNewestSettled(const std::string& job, std::uint32_t rank, const CancelCheck& cancelled,
                               const std::function<void(const ShardMeta&)>& waiting_for = nullptr) const
      EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::map<std::pair<std::string, std::uint64_t>, std::vector<std::weak_ptr<ShardJob>>> by_version_
      GUARDED_BY(mu_);
  std::deque<std::shared_ptr<ShardJob>> recent_ GUARDED_BY(mu_);
};

}  // namespace ckpt
