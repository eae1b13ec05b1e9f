#include "daemon/commit/commit_tracker.h"

#include <spdlog/spdlog.h>

#include <vector>

namespace ckpt {
namespace {

// How often a `latest` that a failed write left stale is rewritten (Catalog::RepairLatest).
constexpr std::chrono::seconds kRepairEvery{1};

}  // namespace

CommitTracker::CommitTracker(Catalog& catalog, ShardRegistry& shards, Hooks hooks, ReplicaWait replica_wait)
    : catalog_(catalog), shards_(shards), hooks_(std::move(hooks)), replica_wait_(replica_wait) {}

void CommitTracker::Start() {
  watcher_ = std::thread([this] { WatchLoop(); });
}

void CommitTracker::Stop() {
  if (replication_stopped_) {
    // The versions that waited only for replicas commit now, on persistence alone, rather
    // than be left for a restart that may never come (a job's daemon stopped by its epilog).
    std::vector<std::pair<Key, std::uint32_t>> waiting;
    {
      MutexLock lock(mu_);
      if (!stop_) {
        for (const auto& [key, a] : deciding_) {
          if (!UnsettledLocked(key)) waiting.emplace_back(key, a.world_size);
        }
      }
    }
    for (const auto& [key, world_size] : waiting) TryCommit(key.first, key.second, world_size, nullptr);
  }
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  if (watcher_.joinable()) watcher_.join();
}

bool CommitTracker::OnPersisted(const ShardMeta& m, const std::shared_ptr<ShardJob>& shard) {
  if (shard) shard->MarkPersisted();  // before the marker: a commit may follow at once
  const Key key{m.job, m.version};
  {
    MutexLock lock(mu_);
    Marker& marker = markers_[key];
    marker.pending[m.rank] = m.session;
    if (shard) marker.pending_shards.push_back(shard);
    if (m.rank == 0) AwaitLocked(deciding_, m);
    if (!deciding_.count(key)) AwaitLocked(watching_, m);
  }
  // Synchronous where this shard completes the marker and this daemon decides: a waiter
  // woken by `persisted` sees the decision.
  const bool ok = FlushMarker(key, shard);
  wake_.SignalAll();
  return ok;
}

bool CommitTracker::InFlightLocked(const Key& key, const Marker& marker) {
  for (const auto& s : shards_.Version(key.first, key.second)) {
    if (s->failed()) continue;
    const ShardMeta& m = s->meta();
    auto handed = [&](const NodeClaims& c) {
      auto it = c.find(m.rank);
      return it != c.end() && it->second == m.session;
    };
    if (!handed(marker.pending) && !handed(marker.durable)) return true;
  }
  return false;
}

bool CommitTracker::UnsettledLocked(const Key& key) {
  auto it = markers_.find(key);
  return it != markers_.end() && (it->second.writing || !it->second.pending.empty());
}

bool CommitTracker::FlushMarker(const Key& key, const std::shared_ptr<ShardJob>& caller) {
  bool caller_ok = true;
  for (;;) {
    NodeClaims claims;
    std::uint64_t replaces = 0;
    std::vector<std::shared_ptr<ShardJob>> batch;
    NodeClaims batch_claims;
    {
      MutexLock lock(mu_);
      auto it = markers_.find(key);
      if (it == markers_.end()) return caller_ok;
      Marker& marker = it->second;
      if (marker.writing || marker.pending.empty() || InFlightLocked(key, marker)) return caller_ok;
      marker.writing = true;
      claims = marker.durable;
      for (const auto& [rank, registration] : marker.pending) claims[rank] = registration;
      replaces = marker.durable.size();
      batch = std::move(marker.pending_shards);
      batch_claims = std::move(marker.pending);
      marker.pending_shards.clear();
      marker.pending.clear();
    }
    Status st = catalog_.WriteNodeMarker(key.first, key.second, claims, replaces);
    bool decides = false;
    {
      MutexLock lock(mu_);
      if (auto it = markers_.find(key); it != markers_.end()) {
        it->second.writing = false;
        if (st.ok()) it->second.durable = std::move(claims);
      }
      decides = deciding_.count(key) != 0;
    }
    if (!st.ok()) {
      std::string ranks;
      for (const auto& [rank, registration] : batch_claims) {
        ranks += (ranks.empty() ? "" : ",") + std::to_string(rank);
      }
      st = st.With("marker of rank(s) " + ranks);
      bool any_shard = false;
      for (const auto& p : batch) {
        p->Fail(st);  // the caller's shard: the flush engine or the promoter reports it
        if (p == caller) {
          caller_ok = false;
        } else {
          hooks_.on_shard_failed(p);
        }
        any_shard = true;
      }
      if (!any_shard) {
        hooks_.on_error("job " + key.first + " version " + std::to_string(key.second) + ": " + st.message());
      }
      if (caller == nullptr) caller_ok = false;
      continue;  // what came meanwhile is written on its own
    }
    wake_.SignalAll();  // the version is polled again from now on
    if (decides) {
      std::uint32_t world_size = 0;
      {
        MutexLock lock(mu_);
        if (auto it = deciding_.find(key); it != deciding_.end()) world_size = it->second.world_size;
      }
      if (world_size != 0) TryCommit(key.first, key.second, world_size, caller);
    }
  }
}

void CommitTracker::Await(const ShardMeta& m) {
  {
    MutexLock lock(mu_);
    auto key = std::make_pair(m.job, m.version);
    if (m.rank == 0) AwaitLocked(deciding_, m);
    if (!deciding_.count(key)) AwaitLocked(watching_, m);
  }
  wake_.SignalAll();
}

void CommitTracker::AwaitLocked(std::map<Key, Awaited>& m, const ShardMeta& meta) {
  Awaited& a = m[{meta.job, meta.version}];
  a.world_size = meta.world_size;  // the newest registration's word
  if (a.superseded == Clock::time_point{} && meta.version < catalog_.Latest(meta.job)) {
    a.superseded = Clock::now();
  }
  // Progress of this daemon on the version: the next look comes soon again.
  a.interval = kPollFirst;
  a.next_poll = Clock::now() + kPollFirst;
}

void CommitTracker::RolledBack(const std::string& job, std::uint64_t version) {
  std::vector<std::pair<Key, Awaited>> set_aside;
  {
    MutexLock decide(decide_mu_);
    // Numbers above `version` are used again by the new timeline.
    for (auto i = given_up_.begin(); i != given_up_.end();) {
      i = i->first == job && i->second > version ? given_up_.erase(i) : std::next(i);
    }
    MutexLock lock(mu_);
    auto& done = finished_[job];
    done.erase(done.upper_bound(version), done.end());
    for (auto i = markers_.begin(); i != markers_.end();) {
      i = i->first.first == job && i->first.second > version ? markers_.erase(i) : std::next(i);
    }
    for (auto* m : {&deciding_, &watching_}) {
      for (auto i = m->begin(); i != m->end();) {
        if (i->first.first == job && i->first.second > version) {
          set_aside.emplace_back(*i);
          i = m->erase(i);
        } else {
          ++i;
        }
      }
    }
  }
  for (const auto& [key, awaited] : set_aside) {
    for (const auto& p : shards_.TakeVersion(key.first, key.second)) {
      // Set aside on purpose (the job rolled back), not failed.
      p->Skip(FailedPrecondition("version " + std::to_string(key.second) + " of job '" + key.first +
                                 "' will not commit: a rank restored version " + std::to_string(version) +
                                 " (a rollback) before it was complete"),
              /*superseded_by=*/0);
      hooks_.on_shard_failed(p);
    }
  }
}

std::uint64_t CommitTracker::NewestFinished(const std::string& job) {
  MutexLock lock(mu_);
  auto it = finished_.find(job);
  return it == finished_.end() || it->second.empty() ? 0 : *it->second.rbegin();
}

void CommitTracker::Forget(const std::string& job, std::uint64_t version) {
  std::vector<std::shared_ptr<ShardJob>> shards;
  {
    MutexLock decide(decide_mu_);
    if (catalog_.IsCommitted(job, version)) return;
    given_up_.insert({job, version});
    MutexLock lock(mu_);
    deciding_.erase({job, version});
    watching_.erase({job, version});
    markers_.erase({job, version});
    shards = shards_.TakeVersion(job, version);
  }
  for (const auto& p : shards) {
    p->ClaimErrorReport();  // restored from memory: not news to any trainer
    p->Skip(FailedPrecondition("version " + std::to_string(version) + " of job '" + job +
                               "' will not commit: it was restored before it was committed, and the job goes on "
                               "from it"),
            /*superseded_by=*/0);
  }
}

void CommitTracker::SupersedeLocked(const std::string& job, std::uint64_t version) {
  const auto now = std::chrono::steady_clock::now();
  for (auto* m : {&deciding_, &watching_}) {
    for (auto& [key, awaited] : *m) {
      if (key.first == job && key.second < version &&
          awaited.superseded == std::chrono::steady_clock::time_point{}) {
        awaited.superseded = now;
      }
    }
  }
}

void CommitTracker::GiveUp(const Key& key, const Awaited& awaited) {
  {
    MutexLock decide(decide_mu_);
    if (catalog_.IsCommitted(key.first, key.second)) return;  // it made it after all
    given_up_.insert(key);
    MutexLock lock(mu_);
    deciding_.erase(key);
    watching_.erase(key);
    markers_.erase(key);
  }
  const std::string why =
      "version " + std::to_string(key.second) + " of job '" + key.first +
      "' did not commit: it was still incomplete " + std::to_string(kGiveUpAfter.count()) +
      " s after a newer version committed (a rank of its " + std::to_string(awaited.world_size) +
      " never persisted it, or registered again meanwhile); given up";
  // A newer version committed and this one never completed: it is superseded, as a version
  // the persist queue skips is, not an error of its ranks (a rank that failed to persist it
  // reports that failure itself).
  spdlog::info("{}", why);
  const std::uint64_t newer = catalog_.Latest(key.first);
  for (const auto& p : shards_.TakeVersion(key.first, key.second)) {
    p->Skip(FailedPrecondition(why), newer);
    hooks_.on_shard_failed(p);
  }
}

Catalog::ReplicaGate* CommitTracker::GateFor(const Key& key, Catalog::ReplicaGate* gate, std::string* reason) {
  if (!replica_wait_.replicas) return nullptr;
  gate->replicas = true;
  const std::uint64_t latest = catalog_.Latest(key.first);
  if (key.second < latest) {
    // A newer version is committed: that one is what a lost node restores, so this one's
    // replicas are not worth a wait.
    gate->commit_anyway = true;
    *reason = "superseded";
    gate->commit_anyway_why = "superseded: version " + std::to_string(latest) +
                              " had committed before these ranks' shards were held by " +
                              std::to_string(replica_wait_.copies) + " peer(s)";
    return gate;
  }
  if (replication_stopped_) {
    gate->commit_anyway = true;
    *reason = "shutdown";
    gate->commit_anyway_why =
        "shutdown: this daemon stopped replicating before these ranks' shards were held by " +
        std::to_string(replica_wait_.copies) + " peer(s)";
    return gate;
  }
  MutexLock lock(mu_);
  auto it = deciding_.find(key);
  if (it != deciding_.end() && it->second.unreplicated_since != Clock::time_point{} &&
      Clock::now() - it->second.unreplicated_since >= replica_wait_.timeout) {
    gate->commit_anyway = true;
    *reason = "timeout";
    gate->commit_anyway_why = "timeout: not held by " + std::to_string(replica_wait_.copies) + " peer(s) " +
                              std::to_string(replica_wait_.timeout.count()) +
                              " s after every rank persisted the version (--replica-commit-timeout-s)";
  }
  return gate;
}

void CommitTracker::NoteUnreplicated(const Key& key, const Catalog::ReplicaGate& gate) {
  std::string ranks;
  for (std::uint32_t r : gate.unreplicated) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
  {
    MutexLock lock(mu_);
    auto it = deciding_.find(key);
    if (it == deciding_.end()) return;
    Awaited& a = it->second;
    if (a.unreplicated_since == Clock::time_point{}) a.unreplicated_since = Clock::now();
    if (a.unreplicated_logged) return;
    a.unreplicated_logged = true;
  }
  spdlog::info(
      "job {} version {}: persisted by every rank; waiting for rank(s) {} to be held by {} peer(s) before "
      "it commits (at most {} s)",
      key.first, key.second, ranks, replica_wait_.copies, replica_wait_.timeout.count());
}

void CommitTracker::TryCommit(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                              const std::shared_ptr<ShardJob>& shard, std::uint64_t* claimed) {
  bool committed = false;
  Status st;
  Catalog::ReplicaGate gate_storage;
  std::string reason;  // why it may commit without every replica: the metric's label
  Catalog::ReplicaGate* gate = GateFor({job, version}, &gate_storage, &reason);
  {
    MutexLock decide(decide_mu_);
    if (given_up_.count({job, version}) != 0) {
      MutexLock lock(mu_);
      deciding_.erase({job, version});  // a late shard of a version given up: it stays so
      return;
    }
    st = catalog_.CommitIfComplete(job, version, world_size, &committed, claimed, gate);
  }
  if (committed) {
    if (gate != nullptr && gate->under_replicated) {
      const std::string text = catalog_.UnderReplicated(job, version);
      const bool superseded = reason == "superseded";
      const std::string message =
          "job " + job + " version " + std::to_string(version) + " committed under-replicated (" + text +
          ")" + (superseded ? "" : "; a node lost now restores those ranks from the persistent tier");
      if (superseded) {
        spdlog::info("{}", message);
      } else {
        spdlog::warn("{}", message);
      }
      if (hooks_.on_under_replicated) hooks_.on_under_replicated(job, reason, message);
    }
    Finish(job, version, shard, /*ours=*/true);
    return;
  }
  if (st.ok()) {
    if (gate != nullptr && !gate->unreplicated.empty()) NoteUnreplicated({job, version}, *gate);
    return;  // not complete yet: the watcher looks again
  }
  std::vector<std::shared_ptr<ShardJob>> failed;
  {
    MutexLock lock(mu_);
    deciding_.erase({job, version});
    markers_.erase({job, version});
    failed = shards_.TakeVersion(job, version);
  }
  hooks_.on_error("job " + job + " version " + std::to_string(version) + ": commit failed: " + st.message());
  // Every rank of the version hears of the failed commit, as of any flush failure.
  for (const auto& p : failed) {
    p->Fail(st.With("commit"));
    hooks_.on_shard_failed(p);
  }
}

void CommitTracker::Finish(const std::string& job, std::uint64_t version,
                           const std::shared_ptr<ShardJob>& shard, bool ours) {
  std::vector<std::shared_ptr<ShardJob>> raised;
  {
    MutexLock lock(mu_);
    // The watcher and a writer may both see the commit: the first one finishes it.
    auto& done = finished_[job];
    if (!done.insert(version).second) return;
    while (done.size() > kFinishedKept) done.erase(done.begin());
    raised = shards_.TakeVersion(job, version);
    deciding_.erase({job, version});
    watching_.erase({job, version});
    markers_.erase({job, version});
    // Older versions still awaited may yet complete; they get kGiveUpAfter from now.
    SupersedeLocked(job, version);
  }
  if (ours) {
    ++committed_total_;
    spdlog::info("job {}: version {} committed", job, version);
  } else {
    spdlog::debug("job {}: version {} committed by rank 0's daemon", job, version);
  }
  // The tiers' retention first, so that a trainer woken by the commit finds them settled.
  hooks_.on_committed(job, version);
  // Only shards that are persisted are part of the commit (each is marked before its done
  // marker, so none is missed); one whose writer has not raised it to persisted yet goes
  // straight to committed, which implies persisted.
  for (const auto& p : raised) {
    if (p == shard || p->persisted()) p->Reach(Level::kCommitted);
  }
}

void CommitTracker::WatchLoop() {
  auto repaired = Clock::now();
  for (;;) {
    std::map<Key, Awaited> deciding, watching;
    std::vector<Key> deferred;
    {
      MutexLock lock(mu_);
      if (stop_) return;
      // Sleeps until the next awaited version is due (without touching storage while none
      // is); a marker held back for a shard on its way is looked at on each wake-up, since
      // that shard may fail without telling the tracker.
      // A version whose marker from here is not out yet cannot be complete: it is not
      // polled (and does not set the time to wake up) until the marker is written.
      Clock::time_point due = Clock::now() + kRepairEvery;
      bool held_back = false;
      for (const auto* m : {&deciding_, &watching_}) {
        for (const auto& [key, a] : *m) {
          if (!UnsettledLocked(key)) due = std::min(due, a.next_poll);
        }
      }
      for (const auto& [key, marker] : markers_) held_back |= !marker.pending.empty();
      if (held_back) due = std::min(due, Clock::now() + kPollMax);
      const auto now = Clock::now();
      if (due > now) wake_.WaitFor(mu_, due - now);
      if (stop_) return;
      const auto woke = Clock::now();
      for (auto [src, dst] : {std::pair{&deciding_, &deciding}, std::pair{&watching_, &watching}}) {
        for (const auto& [key, a] : *src) {
          if (a.next_poll <= woke && !UnsettledLocked(key)) dst->emplace(key, a);
        }
      }
      for (const auto& [key, marker] : markers_) {
        if (!marker.pending.empty() && !marker.writing) deferred.push_back(key);
      }
    }
    const auto now = Clock::now();
    if (now - repaired >= kRepairEvery) {
      catalog_.RepairLatest();
      repaired = now;
    }
    for (const auto& key : deferred) FlushMarker(key, nullptr);
    auto overdue = [&](const Awaited& a) {
      return a.superseded != Clock::time_point{} && now - a.superseded > kGiveUpAfter;
    };
    // The next look at a version: soon again while the decider sees progress, else later.
    auto backoff = [&](std::map<Key, Awaited>& m, const Key& key, std::uint64_t claimed) {
      auto it = m.find(key);
      if (it == m.end()) return;
      Awaited& a = it->second;
      if (claimed <= a.claimed) a.interval = std::min<Clock::duration>(a.interval * 2, kPollMax);
      a.claimed = std::max(a.claimed, claimed);
      a.next_poll = Clock::now() + a.interval;
    };
    for (const auto& [key, awaited] : deciding) {
      std::uint64_t claimed = 0;
      TryCommit(key.first, key.second, awaited.world_size, nullptr, &claimed);
      if (overdue(awaited)) {
        GiveUp(key, awaited);
        continue;
      }
      MutexLock lock(mu_);
      if (key.second < catalog_.Latest(key.first)) SupersedeLocked(key.first, catalog_.Latest(key.first));
      backoff(deciding_, key, claimed);
    }
    for (const auto& [key, awaited] : watching) {
      if (catalog_.IsCommitted(key.first, key.second)) {
        catalog_.NoteCommitted(key.first, key.second);
        Finish(key.first, key.second, nullptr, /*ours=*/false);
        continue;
      }
      if (overdue(awaited)) {
        GiveUp(key, awaited);
        continue;
      }
      MutexLock lock(mu_);
      // Committed by another daemon: the cache says so.
      if (key.second < catalog_.Latest(key.first)) SupersedeLocked(key.first, catalog_.Latest(key.first));
      backoff(watching_, key, 0);
    }
  }
}

}  // namespace ckpt
