// Promoter: moves shards from the local tier to the persistent tier, oldest first, on one
// thread of its own. In: shards published on the local tier (the flush engine, through the
// daemon) and shards a restart cut off (LocalTier::ScanUncommitted). Out: a persisted shard
// goes to `on_persisted` (the commit tracker writes its done marker); a failed promotion
// fails the shard (`on_failed`) or, for a resumed one that no trainer waits on, is recorded
// (`on_error`). A queued shard's version is pinned on the local tier until its promotion
// ends. The copy reads the memory tier's image when it still has one, else the local file.
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "daemon/commit/catalog.h"
#include "daemon/pipeline/shard_copier.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/tiers/local_tier.h"
#include "daemon/tiers/memory_tier.h"

namespace ckpt {

class Promoter {
 public:
  struct Hooks {
    // The shard is durable on the persistent tier; false if its done marker failed (the
    // shard, if any, has been failed by then).
    std::function<bool(const ShardMeta&, const std::shared_ptr<ShardJob>&)> on_persisted;
    // The shard failed (its error is set).
    std::function<void(const std::shared_ptr<ShardJob>&)> on_failed;
    // A resumed promotion failed.
    std::function<void(const std::string&)> on_error;
  };
  struct Task {
    ShardMeta meta;
    std::string local_path;
    std::uint64_t file_bytes = 0;
    std::shared_ptr<ShardJob> shard;  // null for a promotion resumed after a restart
  };

  Promoter(LocalTier& local, MemoryTier& memory, ShardCopier& copier, const Catalog& catalog,
           bool persistent_direct_io, Hooks hooks);
  ~Promoter() { Stop(); }

  void Start();
  // Finishes the queued promotions (a restart would resume them anyway), then stops.
  void Stop() EXCLUDES(mu_);

  // Pins the task's version on the local tier and queues it.
  void Enqueue(Task task) EXCLUDES(mu_);
  // Promotions queued or running.
  std::uint32_t pending() const EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);
  void Promote(const Task& task);

  LocalTier& local_;
  MemoryTier& memory_;
  ShardCopier& copier_;
  const Catalog& catalog_;
  const bool persistent_direct_io_;
  const Hooks hooks_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Task> queue_ GUARDED_BY(mu_);
  bool running_ GUARDED_BY(mu_) = false;  // a task is being copied
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ckpt
