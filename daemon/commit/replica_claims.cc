#include "daemon/commit/replica_claims.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <vector>

namespace ckpt {

ReplicaClaims::ReplicaClaims(Catalog& catalog, std::function<void(const std::string&)> report)
    : catalog_(catalog), report_(std::move(report)) {
  rechecker_ = std::thread([this] { RecheckLoop(); });
}

void ReplicaClaims::Stop() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.SignalAll();
  if (rechecker_.joinable()) rechecker_.join();
}

bool ReplicaClaims::Decide(const Key& key, std::uint32_t world_size) {
  bool restorable = false;
  if (Status st = catalog_.DecideRestorable(key.first, key.second, world_size, &restorable); !st.ok()) {
    if (!catalog_.HasVersionDir(key.first, key.second)) {
      // Its directory went after the claim (retention, or a rollback set it aside).
      spdlog::debug("job {} version {}: gone from the persistent tier; no longer looked at", key.first, key.second);
      return true;
    }
    spdlog::warn("job {} version {}: whether it is restorable from memory is not known yet: {}", key.first,
                 key.second, st.message());
    return false;
  }
  if (restorable) {
    spdlog::info("job {}: version {} is restorable from memory (every rank's shard replicated)", key.first,
                 key.second);
    return true;
  }
  return catalog_.IsCommitted(key.first, key.second);
}

void ReplicaClaims::Submit(const ShardMeta& meta) {
  {
    MutexLock lock(mu_);
    if (stop_) return;
    submitted_.push_back(meta);
  }
  wake_.SignalAll();
}

Status ReplicaClaims::OnReplicated(const ShardMeta& m) { return Claim(m, Clock::now(), {}); }

Status ReplicaClaims::Claim(const ShardMeta& m, Clock::time_point since, Clock::duration waited) {
  if (!ParseRegistration(m.session)) {
    // A shard without a registration id (a client of an older protocol) cannot be matched
    // against the rank's current registration, so it never makes its version restorable.
    return Status::Ok();
  }
  // Committed already (persistence was faster): the commit is what restores read.
  if (catalog_.IsCommitted(m.job, m.version)) return Status::Ok();
  const Key key{m.job, m.version};
  NodeClaims claims;
  std::uint64_t replaces = 0;
  {
    MutexLock lock(mu_);
    auto it = durable_.find(key);
    if (it == durable_.end()) {
      it = durable_.emplace(key, NodeClaims{}).first;
      order_.push_back(key);
      while (order_.size() > kVersionsKept) {
        durable_.erase(order_.front());
        order_.pop_front();
      }
    }
    replaces = it->second.size();
    claims = it->second;
  }
  claims[m.rank] = m.session;
  // One sender thread claims in turn; a write that fails leaves the marker on storage as it was.
  if (Status st = catalog_.WriteNodeMarker(m.job, m.version, claims, replaces, NodeMarkerKind::kReplicated);
      !st.ok()) {
    // No directory (the marker's create found none, or it is not there now): no shard of the
    // version is on the persistent tier yet, and the claim waits for one, unless a newer
    // version committed meanwhile, on any node (then no restore reads this one). The
    // directory may have appeared since the write failed: the next try then succeeds.
    if (st.code() == StatusCode::kNotFound || !catalog_.HasVersionDir(m.job, m.version)) {
      if (catalog_.Latest(m.job) > m.version || catalog_.RefreshLatest(m.job) > m.version) return Status::Ok();
      const auto now = Clock::now();
      if (now - since <= kRecheckFor) {
        MutexLock lock(mu_);
        if (stop_) return Status::Ok();
        Unwritten& u = unwritten_[{m.job, m.version, m.rank}];
        u.interval = waited == Clock::duration::zero() ? Clock::duration(kRecheckFirst)
                                                       : std::min<Clock::duration>(waited * 2, kRecheckMax);
        u.meta = m;
        u.since = since;
        u.next = now + u.interval;
        wake_.SignalAll();
        return Status::Ok();
      }
      return st.With("claim version " + std::to_string(m.version) + " rank " + std::to_string(m.rank) +
                     " of job " + m.job + " replicated: the version has no directory on the persistent tier " +
                     std::to_string(kRecheckFor.count()) + " s after its replicas were held");
    }
    return st.With("claim version " + std::to_string(m.version) + " rank " + std::to_string(m.rank) +
                   " of job " + m.job + " replicated");
  }
  {
    MutexLock lock(mu_);
    if (auto it = durable_.find(key); it != durable_.end()) it->second = claims;
  }
  if (Decide(key, m.world_size)) return Status::Ok();
  {
    MutexLock lock(mu_);
    const auto now = Clock::now();
    Pending& p = pending_[key];
    if (p.world_size == 0) p.since = now;
    p.world_size = m.world_size;
    p.interval = kRecheckFirst;
    p.next = now + kRecheckFirst;
  }
  wake_.SignalAll();
  return Status::Ok();
}

void ReplicaClaims::RecheckLoop() {
  for (;;) {
    std::vector<std::pair<Key, std::uint32_t>> due;
    {
      MutexLock lock(mu_);
      if (stop_) return;
      if (!submitted_.empty()) {
        const ShardMeta next = std::move(submitted_.front());
        submitted_.pop_front();
        lock.Unlock();
        if (Status st = OnReplicated(next); !st.ok() && report_) report_("replication: " + st.message());
        continue;
      }
      if (pending_.empty() && unwritten_.empty()) {
        wake_.Wait(mu_);
        continue;
      }
      auto next = Clock::time_point::max();
      for (const auto& [key, p] : pending_) next = std::min(next, p.next);
      for (const auto& [key, u] : unwritten_) next = std::min(next, u.next);
      if (next > Clock::now()) {
        wake_.WaitUntil(mu_, next);
        continue;
      }
      const auto now = Clock::now();
      for (auto it = unwritten_.begin(); it != unwritten_.end();) {
        if (it->second.next > now) {
          ++it;
          continue;
        }
        // Tried again outside the lock; a claim still waiting queues itself again.
        const Unwritten u = it->second;
        unwritten_.erase(it);
        lock.Unlock();
        if (Status st = Claim(u.meta, u.since, u.interval); !st.ok() && report_) report_("replication: " + st.message());
        lock.Lock();
        if (stop_) return;
        it = unwritten_.begin();
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (now - it->second.since > kRecheckFor) {
          spdlog::debug("job {} version {}: not restorable from memory {} s after this daemon's claim (a rank's shard "
                        "was not replicated); no longer looked at",
                        it->first.first, it->first.second, kRecheckFor.count());
          it = pending_.erase(it);
          continue;
        }
        if (it->second.next <= now) due.emplace_back(it->first, it->second.world_size);
        ++it;
      }
    }
    for (const auto& [key, world] : due) {
      const bool done = Decide(key, world);
      MutexLock lock(mu_);
      auto it = pending_.find(key);
      if (it == pending_.end()) continue;
      if (done) {
        pending_.erase(it);
        continue;
      }
      it->second.interval = std::min<Clock::duration>(it->second.interval * 2, kRecheckMax);
      it->second.next = Clock::now() + it->second.interval;
    }
  }
}

}  // namespace ckpt
