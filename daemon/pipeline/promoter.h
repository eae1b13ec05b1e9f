// Promoter: moves shards from the local tier to the persistent tier, on one thread of its
// own. In: shards published on the local tier (the flush engine, through the daemon) and
// shards a restart cut off (LocalTier::ScanUncommitted). Out: a persisted shard goes to
// `on_persisted` (the commit tracker writes its done marker); a failed promotion fails the
// shard (`on_failed`) or, for a resumed one that no trainer waits on, is recorded
// (`on_error`). A queued shard's version is pinned on the local tier until its promotion
// ends or is skipped. The copy reads the memory tier's image when it still has one, else
// the local file.
//
// The queue is bounded by skipping superseded versions (docs/DESIGN-NOTES.md, "Persist
// queue"): when versions of a job arrive faster than the persistent tier absorbs them, a
// queued version that a newer one of its job has reached the queue behind is skipped, so
// the newest goes next. A version whose promotion has started (for any rank) is never
// skipped, so its other ranks can still complete it; a keep-every version (the persistent
// tier's retention keeps multiples of keep_every) is skipped only for a newer keep-every
// version. A skipped shard fails with an error naming the version that superseded it, and
// is marked skipped (ShardJob::Skip, with that version), so that status shows it as skipped,
// not failed (`on_superseded`: its waits end, it is not reported as a failure of the
// trainer's run).
// A new registration of a rank (a restart or a restore) skips the rank's queued shards:
// they belong to a registration that can no longer commit. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "daemon/catalog/catalog.h"
#include "daemon/pipeline/differential.h"
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
    // The shard was skipped (its error says why): its resources go, its trainer is not told
    // of a failure.
    std::function<void(const std::shared_ptr<ShardJob>&)> on_superseded;
  };
  struct Task {
    ShardMeta meta;
    std::string local_path;
    std::uint64_t file_bytes = 0;
    std::shared_ptr<ShardJob> shard;  // null for a promotion resumed after a restart
  };

  // `bases` (may be null) chooses which shards go differential (daemon/pipeline/differential.h).
  Promoter(LocalTier& local, MemoryTier& memory, ShardCopier& copier, const Catalog& catalog,
           bool persistent_direct_io, Hooks hooks, BaseChooser* bases = nullptr);
  ~Promoter() { Stop(); }

  void Start();
  // Finishes the queued promotions (a restart would resume them anyway), then stops.
  void Stop() EXCLUDES(mu_);

  // Pins the task's version on the local tier and queues it; skips what it supersedes (it
  // may be skipped itself, if a newer version of its job came first).
  void Enqueue(Task task) EXCLUDES(mu_);
  // (job, rank) registered again: its queued shards are skipped, a running one is
  // abandoned, and the job's versions count afresh (a restarted run numbers on from the
  // version it restored).
  void RankRegistered(const std::string& job, std::uint32_t rank) EXCLUDES(mu_);
  // A restart of (job, rank) waits for `version`, its newest shard in flight: the rank's
  // older shards are skipped if queued, and abandoned if running (the copy stops at its next
  // piece), so that `version` goes next. They could not commit once the restart registers.
  void SupersedeRankBelow(const std::string& job, std::uint32_t rank, std::uint64_t version) EXCLUDES(mu_);
  // Promotions queued or running.
  std::uint32_t pending() const EXCLUDES(mu_);

 private:
  // What the queue knows of a job since its ranks last registered.
  struct JobState {
    std::uint64_t newest = 0;         // the newest version queued
    std::uint64_t newest_kept = 0;    // the newest keep-every version queued
    std::set<std::uint64_t> started;  // versions whose promotion started, the newest few
    // Ranks of the job whose shards were queued here. Superseded versions are skipped only
    // once every rank of the job (world size) is seen on this daemon: daemons skip on their
    // own timing, so a job spread over several daemons would skip different versions on
    // each, and while trainers outpace storage no version would be persisted by all ranks
    // (none would commit). Such a job keeps the first-in first-out queue.
    std::set<std::uint32_t> ranks;
  };
  struct Skipped {
    Task task;
    std::string why;
    std::uint64_t by = 0;  // the version that superseded it; 0: its rank registered again
  };
  // The version that supersedes a queued shard of `m`, or 0 if none does.
  std::uint64_t SupersededByLocked(const ShardMeta& m, std::uint32_t keep_every) REQUIRES(mu_);
  // Unpins and fails what was taken off the queue.
  void Skip(std::vector<Skipped> skipped);
  // Skips a shard that will not be persisted (`why`; `by` superseded it) and drops its
  // memory image.
  void Supersede(const Task& task, const std::string& why, std::uint64_t by);
  // Abandons the running task if it is of (job, rank) and older than `below` (0: any); `by`
  // is the version that supersedes it (0: none).
  void AbandonRunningLocked(const std::string& job, std::uint32_t rank, std::uint64_t below, std::string why,
                            std::uint64_t by) REQUIRES(mu_);
  void Loop() EXCLUDES(mu_);
  void Promote(const Task& task);

  LocalTier& local_;
  MemoryTier& memory_;
  ShardCopier& copier_;
  const Catalog& catalog_;
  const bool persistent_direct_io_;
  const Hooks hooks_;
  BaseChooser* const bases_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Task> queue_ GUARDED_BY(mu_);
  std::map<std::string, JobState> jobs_ GUARDED_BY(mu_);
  bool running_ GUARDED_BY(mu_) = false;    // a task is being copied
  ShardMeta running_meta_ GUARDED_BY(mu_);  // its shard
  // Set (with the reason) to stop the running copy; cleared when the next one starts.
  std::atomic<bool> abandon_{false};
  std::string abandon_why_ GUARDED_BY(mu_);
  std::uint64_t abandon_by_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ckpt
