// Replicator: where this daemon's shards are replicated (the replica map) and what each peer
// said it holds of them. See replicator.h.
#include <algorithm>

#include "daemon/replication/replicator.h"

namespace ckpt {

void Replicator::NoteAcknowledged(const std::string& peer, const Key& key, std::uint64_t held) {
  MutexLock lock(mu_);
  sent_held_[peer] = Said{held, std::chrono::system_clock::now()};
  auto& peers = holders_[key];
  if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
  const auto& [job, version, rank] = key;
  mapped_jobs_.insert(job);
  // A holder keeps at most --memory-versions + 1 replicas of a rank (the committed ones and
  // one in flight): older acknowledgements no longer say where a copy is.
  const std::size_t kept = static_cast<std::size_t>(memory_.versions()) + 1;
  auto first = holders_.lower_bound(Key{job, 0, 0});
  std::vector<Key> of_rank;
  for (auto it = first; it != holders_.end() && std::get<0>(it->first) == job; ++it) {
    if (std::get<2>(it->first) == rank) of_rank.push_back(it->first);
  }
  for (std::size_t i = 0; i + kept < of_rank.size(); ++i) holders_.erase(of_rank[i]);  // oldest first
}

void Replicator::NoteDropped(const std::string& peer, const std::string& job, std::uint64_t held) {
  ForgetDeltaBases(peer, job, kAllRanks);
  MutexLock lock(mu_);
  sent_held_[peer] = Said{held, std::chrono::system_clock::now()};
  for (auto it = holders_.lower_bound(Key{job, 0, 0});
       it != holders_.end() && std::get<0>(it->first) == job;) {
    auto& peers = it->second;
    peers.erase(std::remove(peers.begin(), peers.end(), peer), peers.end());
    it = peers.empty() ? holders_.erase(it) : std::next(it);
  }
}

void Replicator::ForgetNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) {
  // Every peer's base of the rank: one above `version` is being dropped, and the rank's
  // timeline goes on from `version` with new images.
  ForgetDeltaBases("", job, rank);
  MutexLock lock(mu_);
  for (auto it = holders_.lower_bound(Key{job, version + 1, 0});
       it != holders_.end() && std::get<0>(it->first) == job;) {
    it = std::get<2>(it->first) == rank ? holders_.erase(it) : std::next(it);
  }
}

void Replicator::OnCommitted(const std::string& job, std::uint64_t version) {
  constexpr std::size_t kCommitsKept = 64;
  MutexLock lock(mu_);
  auto& committed = committed_[job];
  committed.insert(version);
  while (committed.size() > kCommitsKept) committed.erase(committed.begin());
  // The holder's rule (MemoryTier::OnCommitted), per rank, newest first: keep the newest
  // --memory-versions committed versions and what is newer than the newest committed one.
  std::map<std::uint32_t, std::vector<Key>> by_rank;  // oldest first
  for (auto it = holders_.lower_bound(Key{job, 0, 0}); it != holders_.end() && std::get<0>(it->first) == job;
       ++it) {
    by_rank[std::get<2>(it->first)].push_back(it->first);
  }
  for (auto& [rank, keys] : by_rank) {
    std::uint32_t committed_seen = 0;
    bool newer_committed = false;
    for (auto k = keys.rbegin(); k != keys.rend(); ++k) {
      bool drop = false;
      if (committed.count(std::get<1>(*k))) {
        newer_committed = true;
        drop = ++committed_seen > memory_.versions();
      } else {
        drop = newer_committed;  // older than a committed version: it never commits
      }
      if (drop) holders_.erase(*k);
    }
  }
}

Replicator::ReplicaMap Replicator::ReplicaMapOf(const std::string& job, bool ask_peers) {
  ReplicaMap out;
  bool known = false;
  {
    MutexLock lock(mu_);
    known = mapped_jobs_.count(job) > 0;
  }
  if (known && !ask_peers) {
    out.source = "acknowledged";
  } else {
    // Each peer says which replicas of the job it holds from this daemon's address: the map
    // of the job is what they say, replacing what the acknowledgements said.
    std::map<Key, std::vector<std::string>> listed;
    std::size_t answered = 0;
    for (std::size_t i : peers_.Ring()) {
      const std::string& peer = peers_.addresses[i];
      auto held = ReplicasSentFrom(peer, job);
      if (!held.ok()) {
        out.unanswered.push_back(peer + ": " + held.status().message());
        continue;
      }
      ++answered;
      for (const ReplicaHeld& r : held.value()) listed[Key{job, r.version, r.rank}].push_back(peer);
    }
    if (answered == 0) {
      out.source = "unknown";
    } else {
      out.source = "listed";
      MutexLock lock(mu_);
      auto it = holders_.lower_bound(Key{job, 0, 0});
      while (it != holders_.end() && std::get<0>(it->first) == job) it = holders_.erase(it);
      holders_.insert(listed.begin(), listed.end());
      // With a peer unanswered the job's part is incomplete: asked again next time.
      if (out.unanswered.empty()) mapped_jobs_.insert(job);
    }
    if (answered == 0) return out;
  }
  MutexLock lock(mu_);
  for (auto it = holders_.lower_bound(Key{job, 0, 0}); it != holders_.end() && std::get<0>(it->first) == job;
       ++it) {
    out.holders[{std::get<1>(it->first), std::get<2>(it->first)}] = it->second;
  }
  return out;
}

std::vector<Replicator::RankHolders> Replicator::JobReplicationOf(const std::string& job,
                                                                  std::uint64_t version) {
  std::map<std::uint32_t, RankHolders> ranks;
  MutexLock lock(mu_);
  for (auto it = holders_.lower_bound(Key{job, version, 0});
       it != holders_.end() && std::get<0>(it->first) == job && std::get<1>(it->first) == version; ++it) {
    auto& r = ranks[std::get<2>(it->first)];
    r.rank = std::get<2>(it->first);
    r.peers = it->second;
  }
  // Shards sent or given up on, whose peers did not all acknowledge.
  for (auto it = states_.lower_bound(Key{job, version, 0});
       it != states_.end() && std::get<0>(it->first) == job && std::get<1>(it->first) == version; ++it) {
    auto& r = ranks[std::get<2>(it->first)];
    r.rank = std::get<2>(it->first);
    if (r.peers.size() >= peers_.replicas) continue;
    r.error = !it->second.done        ? "still being sent"
              : it->second.error.ok() ? std::string()
                                      : it->second.error.message();
  }
  std::vector<RankHolders> out;
  for (auto& [rank, r] : ranks) out.push_back(std::move(r));
  return out;
}

std::vector<std::string> Replicator::ReplicatedJobs() {
  std::set<std::string> jobs;
  MutexLock lock(mu_);
  for (const auto& [key, state] : states_) jobs.insert(std::get<0>(key));
  for (const auto& [key, peers] : holders_) jobs.insert(std::get<0>(key));
  return {jobs.begin(), jobs.end()};
}

}  // namespace ckpt
