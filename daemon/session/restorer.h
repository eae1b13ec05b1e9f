// Restorer: fills a session's registered regions with a committed version, from the fastest
// tier holding its shard (TierSet). Before reading, the newest of the rank's versions still
// in flight finishes (typically from a trainer that crashed right after a snapshot: it is
// what the restarted trainer wants); older ones are not waited for. Each copy is checked to be this version's
// shard of this rank of this world size, and its checksums are verified before any byte reaches the regions
// (RestoreEngine); a copy on a faster tier that fails either check is reported (ErrorLog), dropped from its
// tier, and the next tier is read instead. A restore that fails on the persistent tier too returns the error,
// which says whether the regions are untouched (a verification failure) or partly written (a failed copy).
// Restoring an older version than the newest committed one is a rollback: the newer versions are set aside,
// the memory tier drops them, and numbering continues from the restored version. Every restore starts a new
// registration of the rank. A registration at another world size than the version's, or whose
// layouts differ from its own shard's, is restored by ElasticRestore (its items' boxes filled
// from the chunks of every rank's shard that overlap them); the job then goes on at the
// registration's world size. Thread-safe; the caller holds the session's lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/cancellable_wait.h"
#include "common/status.h"
#include "daemon/commit/commit_tracker.h"
#include "daemon/base/error_log.h"
#include "daemon/pipeline/restore_engine.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/session/elastic_restore.h"
#include "daemon/session/registrar.h"
#include "daemon/session/session.h"
#include "daemon/pipeline/tier_set.h"

namespace ckpt {

struct Restored {
  std::uint64_t version = 0;
  Tier tier = Tier::kPersistent;
  std::uint64_t tensor_bytes = 0;
  std::vector<RestoredBlob> blobs;
  std::uint32_t world_size = 0;  // that wrote the version
  bool resharded = false;        // restored by ElasticRestore
  // Not committed yet; restored from peers' memory because its RESTORABLE marker names a
  // shard of every rank that a live daemon holds.
  bool uncommitted = false;
  // Where the time went, in ms (logged as the restore's breakdown): the wait for the rank's
  // newest version in flight, the choice of version and tier, reading and verifying every
  // item, the copy into the regions, and the new registration.
  double wait_ms = 0, plan_ms = 0, verify_ms = 0, preallocate_ms = 0, copy_ms = 0, registration_ms = 0;
};

// Bytes restored, by tier read, and read from files, since the daemon started.
struct RestoreCounters {
  std::atomic<std::uint64_t> from_memory{0}, from_local{0}, from_persistent{0};
  std::atomic<std::uint64_t> from_peer{0};  // peers' memory (peer replication)
  std::atomic<std::uint64_t> bytes_read{0};
  // Restores by ElasticRestore (another world size or decomposition).
  std::atomic<std::uint64_t> resharded{0};
  // Restores of a version not committed yet (restorable from peers' memory).
  std::atomic<std::uint64_t> uncommitted{0};
};

class Restorer {
 public:
  Restorer(TierSet& tiers, RestoreEngine& engine, ShardRegistry& shards, CommitTracker& commits,
           Registrar& registrar, RestoreCounters& counters, ErrorLog& errors, bool restart_waits_newest)
      : tiers_(tiers),
        engine_(engine),
        shards_(shards),
        commits_(commits),
        registrar_(registrar),
        counters_(counters),
        errors_(errors),
        restart_waits_newest_(restart_waits_newest),
        elastic_(engine.storage(), tiers, errors, engine.readers(), engine.backend(), engine.lanes(),
                 engine.limits()) {}

  // Restores `requested` (0: the newest committed version) into the session's regions.
  Result<Restored> Restore(Session& s, std::uint64_t requested, const CancelCheck& cancelled) REQUIRES(s.mu);

 private:
  // Restore without its metrics (duration, error count).
  Result<Restored> RestoreUncounted(Session& s, std::uint64_t requested, const CancelCheck& cancelled)
      REQUIRES(s.mu);
  Status RollBack(Session& s, std::uint64_t version) REQUIRES(s.mu);
  // The version a restore reads, held against retention.
  struct Chosen {
    std::uint64_t version = 0;
    std::uint64_t latest = 0;  // the job's newest committed version
    std::unique_ptr<VersionHold> hold;
    std::uint32_t world_size = 0;  // that wrote it
    // A version not committed yet, restorable from peers' memory: each rank's shard is
    // the one of this registration (empty: committed, any copy is the committed one).
    NodeClaims registrations;
  };
  // `requested` (0: the newest) committed, or with peer replication and `uncommitted_ok`, a
  // newer (or the requested) version not committed yet whose RESTORABLE marker names, for
  // every rank, a shard that some live daemon holds or that is durable.
  Result<Chosen> Choose(Session& s, std::uint64_t requested, bool uncommitted_ok) REQUIRES(s.mu);
  // Whether every rank's shard of `marker` is held by a live daemon (memory, peers) or durable
  // (a done marker); else false, and *missing says which is not.
  bool AllHeld(const std::string& job, std::uint64_t version, const RestorableMarker& marker, std::string* missing);
  // Whether `src` holds the shard of (s.job, version, s.rank) of s.world_size, written by
  // `registration` if given.
  Status CheckIdentity(const Session& s, std::uint64_t version, const ShardSource& src,
                       const std::string* registration) REQUIRES(s.mu);
  // Reads one copy into the regions.
  Result<RestoredShard> ReadCopy(Session& s, std::uint64_t version, const ShardSource& src,
                                 const std::string* registration) REQUIRES(s.mu);
  // The world size that wrote committed `version` (its COMMITTED marker).
  Result<std::uint32_t> VersionWorldSize(const std::string& job, std::uint64_t version);
  // The fast path: the rank's own shard, from the fastest good copy (of `registration`, if given).
  // `fetched`: a peer's replica already fetched (by MatchesOwnShard), read instead of that
  // peer's source.
  Result<Restored> RestoreOwnShard(Session& s, std::uint64_t v, const std::string* registration,
                                   const ShardSource* fetched) REQUIRES(s.mu);
  // Another world size or decomposition.
  Result<Restored> RestoreElastic(Session& s, const ElasticRequest& req) REQUIRES(s.mu);
  ElasticRequest ElasticRequestOf(const Session& s, std::uint64_t v, std::uint32_t version_world)
      REQUIRES(s.mu);

  TierSet& tiers_;
  RestoreEngine& engine_;
  ShardRegistry& shards_;
  CommitTracker& commits_;
  Registrar& registrar_;
  RestoreCounters& counters_;
  ErrorLog& errors_;
  const bool restart_waits_newest_;  // --restart-waits (see Registrar)
  ElasticRestore elastic_;
};

}  // namespace ckpt
