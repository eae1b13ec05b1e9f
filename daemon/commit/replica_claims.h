// ReplicaClaims: from shards replicated to peers' memory (ckptd --replicas) to versions
// restorable before they are committed. Each shard of this daemon that R peers acknowledged is claimed
// in this daemon's `.repl` marker of its version (node-OWNER.K.repl: every rank of the
// version replicated from here so far, with the registration that wrote it; the marker of K
// ranks replaces the one of K-1). Then, once the markers of all daemons claim every rank with
// its current registration, VERSION/RESTORABLE is written (Catalog::DecideRestorable), by
// whichever daemon sees it first. The claims are written by this class's own thread, in
// order (Submit), so that a slow persistent tier never holds up replication: a shard's
// `replicated` level is reported when its peers acknowledge it, and its claim follows.
// Two daemons writing their last claims at once may each list the directory
// before the other's marker is there, so a version claimed here and not restorable yet is
// looked at again by a thread, kRecheckFirst later and then with a doubling backoff up to
// kRecheckMax, until it is restorable, committed, or kRecheckFor has passed (a rank never
// replicated it). A claim can come before its version has a directory on the persistent
// tier (with a local tier, the promotion there follows the replicas): it is written once the
// directory is there, tried again with the same backoff, and dropped when a newer version
// commits first (the claim no longer matters) or after kRecheckFor (reported).
// docs/DESIGN-NOTES.md, peer replication, "Which version all ranks restore from memory".
// Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "format/markers.h"
#include "format/shard_format.h"

namespace ckpt {

class ReplicaClaims {
 public:
  static constexpr std::chrono::milliseconds kRecheckFirst{10};
  static constexpr std::chrono::milliseconds kRecheckMax{1000};
  static constexpr std::chrono::seconds kRecheckFor{60};

  // `report` takes the claims that could not be written (the daemon's error log).
  ReplicaClaims(Catalog& catalog, std::function<void(const std::string&)> report);
  ~ReplicaClaims() { Stop(); }
  void Stop() EXCLUDES(mu_);

  // `meta`'s shard is held by R peers: queues its claim, written by this class's thread (a
  // claim that fails is reported: the shard is replicated all the same, but its version does
  // not become restorable). After Stop(), nothing is claimed.
  void Submit(const ShardMeta& meta) EXCLUDES(mu_);
  // Claims it now, on the caller's thread, and decides whether its version is restorable
  // (now, or later: see the top).
  Status OnReplicated(const ShardMeta& meta) EXCLUDES(mu_);

 private:
  using Clock = std::chrono::steady_clock;
  using Key = std::pair<std::string, std::uint64_t>;  // (job, version)
  static constexpr std::size_t kVersionsKept = 1024;  // versions whose claims are remembered
  struct Pending {
    std::uint32_t world_size = 0;
    Clock::time_point since, next;
    Clock::duration interval{};
  };
  // A claim whose version had no directory yet.
  struct Unwritten {
    ShardMeta meta;
    Clock::time_point since, next;
    Clock::duration interval{};
  };
  // Writes the claim of `meta` (and decides). `since`: when it was first tried; `waited`:
  // the last wait before this try (0 for the first).
  Status Claim(const ShardMeta& meta, Clock::time_point since, Clock::duration waited) EXCLUDES(mu_);
  // Whether the version is done with: restorable or committed (logged once restorable).
  bool Decide(const Key& key, std::uint32_t world_size);
  void RecheckLoop() EXCLUDES(mu_);

  Catalog& catalog_;
  const std::function<void(const std::string&)> report_;
  Mutex mu_;
  CondVar wake_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::deque<ShardMeta> submitted_ GUARDED_BY(mu_);
  // What this daemon's marker of each version claims on storage.
  std::map<Key, NodeClaims> durable_ GUARDED_BY(mu_);
  std::deque<Key> order_ GUARDED_BY(mu_);  // oldest first, to bound durable_
  // Claimed here, not restorable yet.
  std::map<Key, Pending> pending_ GUARDED_BY(mu_);
  // Claims waiting for their version's directory, by (job, version, rank).
  std::map<std::tuple<std::string, std::uint64_t, std::uint32_t>, Unwritten> unwritten_ GUARDED_BY(mu_);
  std::thread rechecker_;
};

}  // namespace ckpt
