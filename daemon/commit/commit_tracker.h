// CommitTracker: from persisted shards to committed versions, across daemons. In: each shard
// of this daemon that is durable on the persistent tier (OnPersisted), and, after a restart,
// versions whose shards were persisted before it (Await). Out: committed versions, whose
// shards here are raised to committed, and whose tiers apply their retention first
// (`on_committed`); a failed commit fails every shard of its version (`on_shard_failed`).
//
// The protocol is the Catalog's (node markers, rank registrations, COMMITTED, `latest`):
// the daemon that persisted rank 0's shard of a version decides its commit; the others
// watch the shared directory for it. This daemon's marker of a version is written once
// none of its shards of the version is still on its way (each persisted or failed), so the
// ranks of one node that finish together cost one marker; a rank that comes later (its
// trainer was late) gets a new marker holding all of them. Decisions are tried at once,
// when this daemon's marker is written; a watcher thread polls the shared directory for each
// awaited version with a backoff: kPollFirst after this daemon's own progress on it, then
// doubling up to kPollMax, held (not doubled) while the decider sees more ranks claimed. It
// touches no file while nothing is awaited. Each commit is finished once here, by whoever
// sees it first.
//
// Versions may commit out of order (a rank's shard of v can be slower than every shard of
// v+1): an older version still commits once complete. One that stays incomplete for
// kGiveUpAfter after a newer version committed will not complete (a rank crashed or was
// restored meanwhile): it is given up, its shards here fail with an error saying so, and
// the daemon logs it, so that no wait on it hangs. The watcher also rewrites, every second,
// a `latest` that a failed write left stale (the version is committed all the same: see
// Catalog). Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "daemon/catalog/catalog.h"
#include "daemon/pipeline/shard_registry.h"
#include "format/markers.h"

namespace ckpt {

class CommitTracker {
 public:
  // How long a version may stay incomplete once a newer version of its job committed.
  static constexpr std::chrono::seconds kGiveUpAfter{60};
  // The polling of an awaited version (see the top).
  static constexpr std::chrono::milliseconds kPollFirst{10};
  static constexpr std::chrono::milliseconds kPollMax{1000};

  struct Hooks {
    // (job, version) committed: the tiers apply their retention.
    std::function<void(const std::string& job, std::uint64_t version)> on_committed;
    // The shard failed (its error is set): its trainer hears of it.
    std::function<void(const std::shared_ptr<ShardJob>&)> on_shard_failed;
    // A failure with no shard to carry it.
    std::function<void(const std::string&)> on_error;
    // This daemon committed a version under-replicated: the job, and what its marker says.
    std::function<void(const std::string& job, const std::string& reason, const std::string& message)>
        on_under_replicated;
  };
  // With peer replication: a version commits once every rank's shard is persisted and held by
  // the peers too (Catalog::ReplicaGate); one persisted everywhere and not replicated
  // `replica_timeout` later, or older than a version that committed, commits anyway, recorded
  // as under-replicated. Off (the commit needs persistence only) when `replicas` is false.
  struct ReplicaWait {
    bool replicas = false;
    std::uint32_t copies = 0;  // --replicas, for the messages
    std::chrono::seconds timeout{0};
  };

  CommitTracker(Catalog& catalog, ShardRegistry& shards, Hooks hooks, ReplicaWait replica_wait);
  CommitTracker(Catalog& catalog, ShardRegistry& shards, Hooks hooks)
      : CommitTracker(catalog, shards, std::move(hooks), ReplicaWait{}) {}
  ~CommitTracker() { Stop(); }

  void Start();
  void Stop() EXCLUDES(mu_);

  // `meta`'s shard is durable on the persistent tier: writes this daemon's marker of the
  // version (now, or once its other shards of the version in flight are persisted or failed),
  // then commits the version if this daemon decides it (else watches for the commit).
  // `shard` may be null (a promotion resumed after a restart). False if the marker could not
  // be written now (the shard, if any, is failed; else the error is recorded); a deferred
  // marker that fails later fails its shards through `on_shard_failed`.
  bool OnPersisted(const ShardMeta& meta, const std::shared_ptr<ShardJob>& shard) EXCLUDES(mu_);
  // After a restart: `meta`'s done marker is already written; awaits the version's commit.
  void Await(const ShardMeta& meta) EXCLUDES(mu_);
  // A rank of `job` rolled back to `version`: versions above it will be committed again, and
  // the ones awaited now never will (they were set aside).
  void RolledBack(const std::string& job, std::uint64_t version) EXCLUDES(mu_);
  // The newest version of `job` whose commit this daemon finished (0: none); RolledBack
  // forgets those above its version. One above the job's newest committed version on
  // storage was set aside by a rollback that another daemon made (see Restorer).
  std::uint64_t NewestFinished(const std::string& job) EXCLUDES(mu_);
  // A rank restored `version` from peers' memory before it was committed: it never commits
  // now (the ranks register again), so it is no longer awaited, and this daemon's shards of
  // it are let go without an error to report (a marker that comes late is ignored).
  void Forget(const std::string& job, std::uint64_t version) EXCLUDES(mu_);

  // The daemon is stopping and its replication stopped first: a version completes on
  // persistence alone from now on (recorded as under-replicated), since no claim of this
  // daemon's shards will come and the versions finishing during the stop must still commit.
  void ReplicationStopped() { replication_stopped_ = true; }

  // Versions this daemon committed since it started.
  std::uint64_t committed_total() const { return committed_total_; }

 private:
  using Key = std::pair<std::string, std::uint64_t>;  // (job, version)
  using Clock = std::chrono::steady_clock;
  struct Awaited {
    std::uint32_t world_size = 0;
    // When a newer version of the job committed while this one was awaited (zero: not yet).
    Clock::time_point superseded{};
    // The backoff of its polling, and the ranks claimed at the decider's last look.
    Clock::time_point next_poll{};
    Clock::duration interval{};
    std::uint64_t claimed = 0;
    // Since when every rank's shard is persisted and some are not replicated yet (zero: not
    // seen so), and whether that was logged.
    Clock::time_point unreplicated_since{};
    bool unreplicated_logged = false;
  };
  // This daemon's marker of one version: what it claims on storage, and what is to be added.
  struct Marker {
    NodeClaims durable;  // in the marker on storage
    NodeClaims pending;  // persisted here, not written yet
    std::vector<std::shared_ptr<ShardJob>> pending_shards;
    bool writing = false;  // one write at a time; what comes meanwhile goes in the next one
  };
  // Writes the marker of (job, version) with everything pending, unless a write is under way
  // or a shard of the version here is still on its way (the last one writes). Commits next if
  // this daemon decides. False if `caller` was in a write that failed.
  bool FlushMarker(const Key& key, const std::shared_ptr<ShardJob>& caller) EXCLUDES(mu_);
  // Whether this daemon's marker of the version is not written yet (being written, or held).
  bool UnsettledLocked(const Key& key) REQUIRES(mu_);
  // Whether a live shard of the version here is neither failed nor handed to OnPersisted.
  bool InFlightLocked(const Key& key, const Marker& marker) REQUIRES(mu_);
  // Marks the awaited versions of `job` older than `version` as superseded (now).
  void SupersedeLocked(const std::string& job, std::uint64_t version) REQUIRES(mu_);
  // Records (job, version) as awaited in `m` (the world size as given); its give-up clock
  // starts at once if a newer version is committed already.
  void AwaitLocked(std::map<Key, Awaited>& m, const ShardMeta& meta) REQUIRES(mu_);
  // Gives up (job, version): it will not complete.
  void GiveUp(const Key& key, const Awaited& awaited) EXCLUDES(mu_);
  void Track(const ShardMeta& meta) EXCLUDES(mu_);
  // Sets *claimed (if given) to the ranks the version's markers claim, for the backoff.
  void TryCommit(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                 const std::shared_ptr<ShardJob>& shard, std::uint64_t* claimed = nullptr) EXCLUDES(mu_);
  // (job, version) is committed (by this daemon if `ours`): raises this daemon's shards of
  // it, stops awaiting it and older versions, applies the tiers' retention.
  void Finish(const std::string& job, std::uint64_t version, const std::shared_ptr<ShardJob>& shard,
              bool ours) EXCLUDES(mu_);
  void WatchLoop() EXCLUDES(mu_);

  // The replication gate of one decision of (job, version): none (null) without replicas.
  // With it, *reason names why it may commit without every replica ("superseded",
  // "shutdown", "timeout"), the label of the metric.
  Catalog::ReplicaGate* GateFor(const Key& key, Catalog::ReplicaGate* gate, std::string* reason) EXCLUDES(mu_);
  // After a decision that waits for replicas: when it started, logged once.
  void NoteUnreplicated(const Key& key, const Catalog::ReplicaGate& gate) EXCLUDES(mu_);

  Catalog& catalog_;
  ShardRegistry& shards_;
  const Hooks hooks_;
  const ReplicaWait replica_wait_;
  // Held across this daemon's commit decisions and its giving up, so that a version is
  // never both committed and given up here. Taken before mu_.
  Mutex decide_mu_ ACQUIRED_BEFORE(mu_);
  std::set<Key> given_up_ GUARDED_BY(decide_mu_);
  Mutex mu_;
  CondVar wake_;
  // Commits this daemon decides (it persisted rank 0's shard) and commits it waits to see
  // (another daemon decides): (job, version) -> world size.
  std::map<Key, Awaited> deciding_ GUARDED_BY(mu_);
  std::map<Key, Awaited> watching_ GUARDED_BY(mu_);
  std::map<Key, Marker> markers_ GUARDED_BY(mu_);
  // Commits finished here, per job (the newest kFinishedKept): each is finished once.
  static constexpr std::size_t kFinishedKept = 4096;
  std::map<std::string, std::set<std::uint64_t>> finished_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<std::uint64_t> committed_total_{0};
  std::atomic<bool> replication_stopped_{false};
  std::thread watcher_;
};

}  // namespace ckpt
