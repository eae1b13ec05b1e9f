#include "daemon/commit/commit_tracker.h"

#include <spdlog/spdlog.h>

#include <vector>

namespace ckpt {
namespace {

// How often the shared directory is read while a commit is awaited, and while none is.
constexpr std::chrono::milliseconds kPollBusy{20};
constexpr std::chrono::milliseconds kPollIdle{500};
// How often a `latest` that a failed write left stale is rewritten (Catalog::RepairLatest).
constexpr std::chrono::seconds kRepairEvery{1};

}  // namespace

CommitTracker::CommitTracker(Catalog& catalog, ShardRegistry& shards, Hooks hooks)
    : catalog_(catalog), shards_(shards), hooks_(std::move(hooks)) {}

void CommitTracker::Start() {
  watcher_ = std::thread([this] { WatchLoop(); });
}

void CommitTracker::Stop() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  if (watcher_.joinable()) watcher_.join();
}

bool CommitTracker::OnPersisted(const ShardMeta& m, const std::shared_ptr<ShardJob>& shard) {
  if (shard) shard->MarkPersisted();  // before the marker: a commit may follow at once
  if (Status st = catalog_.WriteDoneMarker(m.job, m.version, m.rank, m.session); !st.ok()) {
    st = st.With("done marker of rank " + std::to_string(m.rank));
    if (shard) {
      shard->Fail(st);  // the flush engine or the promoter reports it
    } else {
      hooks_.on_error("job " + m.job + " version " + std::to_string(m.version) + ": " + st.message());
    }
    return false;
  }
  bool decides = false;
  {
    MutexLock lock(mu_);
    auto key = std::make_pair(m.job, m.version);
    if (m.rank == 0) AwaitLocked(deciding_, m);
    decides = deciding_.count(key) != 0;
    if (!decides) AwaitLocked(watching_, m);
  }
  // Synchronous where this daemon decides: a waiter woken by `persisted` sees the decision.
  if (decides) TryCommit(m.job, m.version, m.world_size, shard);
  wake_.SignalAll();
  return true;
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
  if (a.superseded == std::chrono::steady_clock::time_point{} && meta.version < catalog_.Latest(meta.job)) {
    a.superseded = std::chrono::steady_clock::now();
  }
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
      p->Fail(FailedPrecondition("version " + std::to_string(key.second) + " of job '" + key.first +
                                 "' will not commit: a rank restored version " + std::to_string(version) +
                                 " (a rollback) before it was complete"));
      hooks_.on_shard_failed(p);
    }
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
  }
  const std::string why =
      "version " + std::to_string(key.second) + " of job '" + key.first +
      "' did not commit: it was still incomplete " + std::to_string(kGiveUpAfter.count()) +
      " s after a newer version committed (a rank of its " + std::to_string(awaited.world_size) +
      " never persisted it, or registered again meanwhile); given up";
  hooks_.on_error(why);
  for (const auto& p : shards_.TakeVersion(key.first, key.second)) {
    p->Fail(FailedPrecondition(why));
    hooks_.on_shard_failed(p);
  }
}

void CommitTracker::TryCommit(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                              const std::shared_ptr<ShardJob>& shard) {
  bool committed = false;
  Status st;
  {
    MutexLock decide(decide_mu_);
    if (given_up_.count({job, version}) != 0) {
      MutexLock lock(mu_);
      deciding_.erase({job, version});  // a late shard of a version given up: it stays so
      return;
    }
    st = catalog_.CommitIfComplete(job, version, world_size, &committed);
  }
  if (committed) {
    Finish(job, version, shard, /*ours=*/true);
    return;
  }
  if (st.ok()) return;  // not complete yet: the watcher looks again
  std::vector<std::shared_ptr<ShardJob>> failed;
  {
    MutexLock lock(mu_);
    deciding_.erase({job, version});
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
  auto repaired = std::chrono::steady_clock::now();
  for (;;) {
    std::map<Key, Awaited> deciding, watching;
    {
      MutexLock lock(mu_);
      if (stop_) return;
      const bool busy = !deciding_.empty() || !watching_.empty();
      // Polls the shared directory while some commit is awaited; idle otherwise.
      wake_.WaitFor(mu_, busy ? kPollBusy : kPollIdle);
      if (stop_) return;
      deciding = deciding_;
      watching = watching_;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - repaired >= kRepairEvery) {
      catalog_.RepairLatest();
      repaired = now;
    }
    auto overdue = [&](const Awaited& a) {
      return a.superseded != std::chrono::steady_clock::time_point{} && now - a.superseded > kGiveUpAfter;
    };
    for (const auto& [key, awaited] : deciding) {
      TryCommit(key.first, key.second, awaited.world_size, nullptr);
      if (overdue(awaited)) {
        GiveUp(key, awaited);
      } else if (key.second < catalog_.Latest(key.first)) {
        MutexLock lock(mu_);
        SupersedeLocked(key.first, catalog_.Latest(key.first));
      }
    }
    for (const auto& [key, awaited] : watching) {
      if (catalog_.IsCommitted(key.first, key.second)) {
        catalog_.NoteCommitted(key.first, key.second);
        Finish(key.first, key.second, nullptr, /*ours=*/false);
      } else if (key.second < catalog_.Latest(key.first)) {
        MutexLock lock(mu_);
        SupersedeLocked(key.first, catalog_.Latest(key.first));  // committed by another daemon
      }
      if (overdue(awaited)) GiveUp(key, awaited);
    }
  }
}

}  // namespace ckpt
