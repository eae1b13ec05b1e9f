// WarmStart: pulls the shards of this node's ranks back from peers' memory into this
// daemon's memory tier, in the background, so that a replacement node's trainers restore
// from local memory instead of fetching every byte while their GPUs wait.
//
// Which shards: a job's newest committed version, and for it the ranks whose replicas the
// peers hold as sent by this daemon's --peers address (ListReplicas): a replacement takes
// the place and the address of the node it replaces (the peer rule), so those are exactly
// the shards that node's ranks captured. Root or the daemon's user may name the ranks
// instead (any peer holding one is read), at most kMaxWarmStartRanks in one call; at most
// kMaxQueuedShards wait in all, so that requests cannot grow the queue without bound. Asked for by `ckptctl prefetch --from-peers` (Start) or, with
// --warm-start, for every job under the root when the daemon starts (StartAll).
//
// In: the peers' images (Replicator::FetchWith), received straight into a buffer of the
// memory tier's budget (an own shard's room: MemoryTier::Reserve). A shard counts as held
// only once it is complete and verified: the stream's checks (order, sizes, header and its
// checksum, the image's MAC of --peer-secret), then every item's xxh3-64 against the header,
// here, before MemoryTier::Complete makes it visible to a restore. A peer that fails (gone
// mid-transfer, stalled, a checksum, a secret that does not match, no room) is reported and
// the next peer holding the shard is read; when none is left the shard is failed, its
// reserved buffer dropped, and the restore reads the next source as without warm start (a
// peer, then the persistent tier). A restore never sees a partial image.
//
// Out: progress per job and shard (Progress(), shown by `ckptctl status`), counters
// (ckptd_warm_start_bytes_total, ckptd_warm_start_shards{state}).
//
// Pacing: one thread pulls one shard at a time, at most `bytes_per_s` (--warm-start-mib-per-s,
// 0: no cap), so that a replacement node does not take the network and its peers' CPU from
// the running jobs' flushes and replication. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/metrics/registry.h"
#include "daemon/pipeline/tier_set.h"
#include "daemon/replication/replicator.h"

namespace ckpt {

// The most ranks one warm start may name (WarmStart RPC).
inline constexpr std::uint32_t kMaxWarmStartRanks = 4096;

// One shard's progress.
struct WarmShardProgress {
  enum class State { kPending, kRunning, kDone, kFailed };
  std::uint32_t rank = 0;
  State state = State::kPending;
  std::uint64_t bytes_done = 0;
  std::uint64_t total_bytes = 0;  // 0 until known (a rank named by the caller)
  std::string peer;               // read from (done), or the last one tried
  std::string error;              // failed: why, every peer tried
};
const char* WarmStateName(WarmShardProgress::State state);  // "pending", "running", "done", "failed"

// One job's warm start.
struct WarmJobProgress {
  std::string job;
  std::uint64_t version = 0;
  WarmShardProgress::State state = WarmShardProgress::State::kPending;
  std::uint64_t bytes_done = 0;
  std::uint64_t total_bytes = 0;
  std::string error;  // the first failed shard's reason, with how many failed
  std::vector<WarmShardProgress> shards;
};

// What Start queued.
struct WarmStartPlan {
  std::uint64_t version = 0;
  std::uint32_t shards = 0;
  std::uint64_t total_bytes = 0;
};

class WarmStart {
 public:
  // `peers` and `tiers` must outlive this. `error`: a failure worth the daemon's error log.
  WarmStart(Replicator& peers, TierSet& tiers, std::uint64_t bytes_per_s, std::function<void(const std::string&)> error);
  ~WarmStart();
  WarmStart(const WarmStart&) = delete;
  WarmStart& operator=(const WarmStart&) = delete;
  // Cancels the transfer in flight and stops the thread; what is queued is not pulled.
  void Stop() EXCLUDES(mu_);

  // Queues the shards of `job`'s newest committed version: `ranks`, or (empty) those the
  // peers hold as sent by this daemon. Shards already in the memory tier are not pulled.
  // NotFound (no committed version, or no peer holds any shard of it from this node),
  // FailedPrecondition (no memory tier), each saying why.
  Result<WarmStartPlan> Start(const std::string& job, std::vector<std::uint32_t> ranks) EXCLUDES(mu_);
  // --warm-start: on the thread, Start(job, {}) for every job of the persistent tier with a
  // committed version; jobs no peer holds a shard of for this node are passed over (logged).
  void StartAll() EXCLUDES(mu_);

  // Every job asked for, oldest first (at most the last kJobsKept).
  std::vector<WarmJobProgress> Progress() EXCLUDES(mu_);
  // ckptd_warm_start_bytes_total, ckptd_warm_start_shards{state}.
  void RenderMetrics(metrics::Exposition& out) EXCLUDES(mu_);

  std::uint64_t bytes_per_s() const { return bytes_per_s_; }

 private:
  static constexpr std::size_t kJobsKept = 64;
  static constexpr std::size_t kMaxQueuedShards = 16384;
  struct Task {
    std::shared_ptr<WarmJobProgress> job;  // its fields under mu_
    std::size_t shard = 0;                 // index in job->shards
    std::vector<std::string> peers;        // the peers that listed it, ring order; empty: ask
    std::shared_ptr<HeldVersion> held;     // keeps the version from retention while pulled
  };
  void Loop() EXCLUDES(mu_);
  void Pull(Task& task) EXCLUDES(mu_);
  // Waits so that `bytes` more keep the pull at or below bytes_per_s_.
  void Pace(std::uint64_t bytes);
  void SetShard(const Task& task, const std::function<void(WarmShardProgress&)>& change) EXCLUDES(mu_);
  static void Summarize(WarmJobProgress& job);

  Replicator& peers_;
  TierSet& tiers_;
  const std::uint64_t bytes_per_s_;
  const std::function<void(const std::string&)> error_;
  std::atomic<bool> cancel_{false};
  std::atomic<std::uint64_t> bytes_total_{0};
  std::atomic<std::uint64_t> shards_done_{0}, shards_failed_{0};
  std::chrono::steady_clock::time_point paced_until_{};  // the puller thread's only

  Mutex mu_;
  CondVar changed_;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool start_all_ GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<WarmJobProgress>> jobs_ GUARDED_BY(mu_);
  std::deque<Task> queue_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ckpt
