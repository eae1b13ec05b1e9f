// Catalog: the daemon's view of the checkpoint tree on the persistent tier (shared by all
// nodes of a job), and the commit stage.
//
// Commit across daemons uses only the shared directory, and its metadata cost per version
// grows with the daemons of a job, not with its ranks (docs/DESIGN-NOTES.md, "Commit at
// scale"). Each registration of a rank (a trainer process, or a restore) takes the rank's
// next generation (JOB/ranks/rank-R records the newest) and leaves its id as a name,
// JOB/ranks/rank-R.GEN.REG: one listing of JOB/ranks/ tells every rank's current
// registration (its highest generation). Each daemon, once shards of its ranks are durable
// in VERSION/, writes one marker for all of them, VERSION/node-OWNER.K.done, naming each
// rank and the registration that wrote its shard (K, the number of ranks, is in the name:
// a listing tells how many ranks are claimed without opening a file). A later rank of the
// same daemon and version gets a new marker holding all of them, and the older one is
// removed. The daemon serving rank 0 writes COMMITTED, then `latest`, once the markers
// claim every rank 0..world_size-1 with the rank's current registration: a shard left by an
// earlier run (a crash before its version committed) never completes a version of this run.
// Markers are read before registrations, so a version whose shards all come from one run
// commits even if the next run starts meanwhile, and a mixed one never does (a rank of the
// new run snapshots only after every rank has registered, since a training step needs all
// ranks). Readers trust only committed versions. At start, Recover() removes *.tmp leftovers
// and rewrites any `latest` that does not name the newest committed version.
//
// The per-rank files of older trees (VERSION/rank-R.done, a registration alone in
// JOB/ranks/rank-R) are not read as markers: a version in flight while its daemons were
// upgraded does not commit (a daemon restart costs the versions in flight anyway); committed
// versions, COMMITTED and `latest` are as they were.
//
// A version is committed once its COMMITTED is durable: every reader (restores, the loader,
// recovery) takes the newest version with COMMITTED, never the `latest` file, which is a
// pointer for people and outside tools. So a failure to write `latest` does not undo a
// commit: the daemon's own newest version is still right, the failure is reported (log and
// status), and the file is rewritten at the next commit or by RepairLatest() (the commit
// tracker calls it every second), whichever comes first. Errors of background work are
// reported through `report` (the daemon's error log). Thread-safe.
//
// The class is spread over files by job:
//   catalog.cc             the commit protocol: version directories, rank registrations,
//                          node markers, COMMITTED
//   catalog_latest.cc      the newest committed version: its cache, scan and `latest` file
//   catalog_recovery.cc    recovery at start-up (Recover)
//   catalog_restorable.cc  RESTORABLE markers (versions restorable from peers' memory)
//   catalog_retention.cc   retention, pins, and a rollback's set-aside
//   catalog_versions.cc    what readers see: jobs, versions, ABORTED markers, sizes
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/catalog/version_index_writer.h"
#include "daemon/io/storage.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

struct VersionEntry {
  std::uint64_t version = 0;
  bool committed = false;
  bool restorable = false;           // a RESTORABLE marker: replicated to peers, not committed
  std::string aborted;               // non-empty: a rank aborted it (the first ABORTED marker's text)
  std::string under_replicated;      // non-empty: committed under-replicated (its marker's text)
  std::vector<std::uint32_t> ranks;  // ranks with a durable shard
};

class Catalog {
 public:
  // `keep_last` > 0: after each commit, delete committed versions older than the newest
  // `keep_last` ones, except multiples of `keep_every` (if > 0).
  // `report` (may be empty: the log only) takes the failures that no caller hears of.
  // `node` names this daemon's markers (empty: the owner of its temporary files, see
  // SetTmpOwner); each Catalog adds a random part, so that a restarted daemon never rewrites
  // a marker of its earlier life.
  using Reporter = std::function<void(const std::string&)>;
  Catalog(std::shared_ptr<Storage> storage, std::string root, std::uint32_t keep_last = 0,
          std::uint32_t keep_every = 0, Reporter report = nullptr, std::string node = {});

  const std::string& root() const { return tree_.root(); }
  // From now on every commit writes the version's index.json (VersionIndexWriter) before its
  // COMMITTED, and fails if it cannot. Called once, before the first commit (the daemon
  // does; catalogs of tests that commit versions without shard files do not).
  void EnableVersionIndex();
  struct Retention {
    std::uint32_t keep_last = 0;
    std::uint32_t keep_every = 0;
  };
  // The retention in force; a reload (SIGHUP) changes it for the commits that follow.
  Retention retention() const;
  void SetRetention(Retention r);
  std::string JobDir(const std::string& job) const;
  std::string VersionDir(const std::string& job, std::uint64_t version) const;
  std::string ShardPath(const std::string& job, std::uint64_t version, std::uint32_t rank) const;

  // Scans every job under the root: removes temporary files, repairs `latest`.
  Status Recover();
  // Creates the version's directory (and the job's), durably.
  Status PrepareVersionDir(const std::string& job, std::uint64_t version);
  // Commits the version if the markers claim every rank with its current registration; sets
  // *committed accordingly, and *claimed (if given) to the ranks the markers' names claim (a
  // measure of progress). One listing of the version directory while ranks are missing; the
  // markers and JOB/ranks/ are read only once the names claim them all. A version older than
  // the newest committed one commits too (its shards may simply have been slower); `latest`
  // never moves back. An error means the version did not commit (no COMMITTED is left); what
  // fails once it is committed (`latest`, retention) is reported, not returned.
  //
  // With `gate.replicas`, every rank's shard must also be claimed replicated (the `.repl`
  // markers, ReplicaClaims) with the same current registration; while one is not, the
  // version does not commit and the ranks missing are in gate.unreplicated (*claimed then
  // counts the replicated claims' names too, as progress). With `gate.commit_anyway` set
  // too it commits all the same, writing UNDER_REPLICATED (the ranks and
  // gate.commit_anyway_why) before COMMITTED, and sets gate.under_replicated.
  struct ReplicaGate {
    bool replicas = false;
    bool commit_anyway = false;
    std::string commit_anyway_why;
    std::vector<std::uint32_t> unreplicated;  // out
    bool under_replicated = false;            // out
  };
  Status CommitIfComplete(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                          bool* committed, std::uint64_t* claimed = nullptr, ReplicaGate* gate = nullptr);
  // The text of the version's UNDER_REPLICATED marker, or "" if it has none.
  std::string UnderReplicated(const std::string& job, std::uint64_t version);
  // Records `registration` as the current one of (job, rank), durably: the rank's next
  // generation in JOB/ranks/rank-R, then its name; the name of the generation it replaces is
  // removed. A failure is also reported (the trainer's call fails, and status shows why).
  Status WriteRankRegistration(const std::string& job, std::uint32_t rank, const std::string& registration);
  // Records that the shards of `claims` (rank -> registration) are durable here: this daemon's
  // marker of the version, replacing its marker of `replaces` ranks (0: none), which must
  // claim a subset. On failure the new marker is not left (one not known to be durable must
  // not count for a commit); the one it replaces stays.
  Status WriteNodeMarker(const std::string& job, std::uint64_t version, const NodeClaims& claims,
                         std::uint64_t replaces, NodeMarkerKind kind = NodeMarkerKind::kDone);
  // Peer replication: a version not committed yet may be restored from peers' memory once
  // every rank's shard is replicated. When the `.repl` markers (WriteNodeMarker with
  // kReplicated) of such a version claim every rank with its current registration: writes
  // VERSION/RESTORABLE naming them (the same rule as a commit's, so that a shard left by an
  // earlier run never completes it); *restorable says whether the version is so now. Any
  // daemon may decide it, each with the same contents, so that all ranks restore the same
  // version from memory.
  Status DecideRestorable(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                          bool* restorable);
  Result<RestorableMarker> ReadRestorable(const std::string& job, std::uint64_t version);
  // The versions above `after` with a RESTORABLE marker, newest first (one listing of the job).
  std::vector<std::uint64_t> RestorableNewerThan(const std::string& job, std::uint64_t after);
  // A restore of `version` left the timeline above it: their RESTORABLE markers go (the
  // numbers are used again), so that a later restore never takes one of them.
  void DropRestorableNewerThan(const std::string& job, std::uint64_t version);
  // Of `wanted` (rank -> registration), the claims that done markers of the version hold:
  // those ranks' shards of those registrations are durable on the persistent tier.
  NodeClaims DurableClaims(const std::string& job, std::uint64_t version, const NodeClaims& wanted);
  // Whether a marker of this node (any earlier life of the daemon included) claims rank's
  // shard of the version with `registration`. For restarts: one listing and this node's markers.
  bool HasDoneMarker(const std::string& job, std::uint64_t version, std::uint32_t rank,
                     const std::string& registration);
  // The owner part of this daemon's marker names.
  const std::string& marker_owner() const { return marker_owner_; }
  // Another daemon committed `version`: the cached `latest` follows.
  void NoteCommitted(const std::string& job, std::uint64_t version);
  // Rescans the job for its newest committed version (another daemon may have committed).
  std::uint64_t RefreshLatest(const std::string& job);
  // Newest committed version of the job, 0 if none. Cached for jobs that exist on storage
  // (a job id nobody created is never cached: List and Prefetch take any id).
  std::uint64_t Latest(const std::string& job);
  // Jobs in the cache of Latest(), for tests.
  std::size_t cached_jobs() EXCLUDES(latest_mu_);
  bool IsCommitted(const std::string& job, std::uint64_t version);
  // Whether the version has a directory on this tree (a shard of it was written here).
  bool HasVersionDir(const std::string& job, std::uint64_t version);
  // Versions of the job on storage, oldest first.
  Result<std::vector<VersionEntry>> List(const std::string& job);
  // The ranks the done markers (`kind`: or the `.repl` markers) of the version claim, each
  // with the owner of the marker that claims it (the writing daemon's --node-id and its
  // start's random part: see MarkerOwnerNode); read only, for reports. An error if the
  // version directory cannot be listed.
  Result<std::map<std::uint32_t, std::string>> MarkerClaims(const std::string& job, std::uint64_t version,
                                                            NodeMarkerKind kind = NodeMarkerKind::kDone);
  // The --node-id part of a marker's owner ("host3-1a2b3c4d" -> "host3").
  static std::string MarkerOwnerNode(const std::string& owner);
  // Records that `rank` aborted the version, and why (VERSION/ABORTED.rank-R): it never
  // commits (the rank's done marker is never written), and readers see why.
  Status WriteAborted(const std::string& job, std::uint64_t version, std::uint32_t rank, const std::string& why);
  // The text of the version's first ABORTED marker, or "" if no rank aborted it.
  std::string AbortedReason(const std::string& job, std::uint64_t version);
  // The job directories under the root (names that are job ids), sorted.
  Result<std::vector<std::string>> Jobs();
  // Bytes of the shard files of `entry` (the ranks List found in it; one deleted since counts 0).
  std::uint64_t VersionBytes(const std::string& job, const VersionEntry& entry);
  // Rollback: moves committed versions newer than `version` under JOB/set-aside/ and
  // points `latest` at `version`. Returns how many were set aside.
  Result<int> SetAsideNewerThan(const std::string& job, std::uint64_t version);
  // Rewrites each `latest` that a failed write left stale (see the top); cheap when none is.
  void RepairLatest() EXCLUDES(commit_mu_);
  // Jobs whose `latest` is known to be stale, for status and tests.
  std::size_t stale_latest() EXCLUDES(commit_mu_);
  // While a version is pinned (a restore reads it), retention does not delete it.
  void Pin(const std::string& job, std::uint64_t version);
  void Unpin(const std::string& job, std::uint64_t version);

 private:
  Status RecoverJob(const std::string& job) REQUIRES(commit_mu_);
  // The ranks' current registrations (rank -> registration, every rank 0..world_size-1) if
  // `markers` (names of `kind` in the version's directory) claim each rank with it; nullopt
  // if any is not so claimed, or ranks/ cannot be listed.
  // The ranks of `current` (rank -> current registration) that no `.repl` marker among
  // `replica_markers` claims with that registration.
  std::vector<std::uint32_t> UnreplicatedRanks(const std::string& job, std::uint64_t version,
                                               const std::vector<std::string>& replica_markers,
                                               const NodeClaims& current);
  std::optional<NodeClaims> CurrentRegistrationsIfClaimed(const std::string& job, std::uint64_t version,
                                                          const std::vector<std::string>& markers,
                                                          NodeMarkerKind kind, std::uint32_t world_size);
  // The newest version with a COMMITTED marker (0: none). An error when the job directory
  // cannot be listed: a failed scan must never be taken for "nothing committed", or
  // `latest` and the cache would move backwards.
  Result<std::uint64_t> ScanLatest(const std::string& job);
  // Records that `latest` of `job` could not be written (`why`) and reports it once.
  void NoteStaleLatest(const std::string& job, std::uint64_t version, const Status& why) REQUIRES(commit_mu_);
  // `latest` is written only under commit_mu_ (commits, rollbacks, recovery, repairs).
  Status WriteLatest(const std::string& job, std::uint64_t version) REQUIRES(commit_mu_);
  // `version` (0: none) is the job's newest committed version: the cache says so at once,
  // then `latest` is written; a failure is reported and the job marked stale (repaired later).
  void PublishLatest(const std::string& job, std::uint64_t version) REQUIRES(commit_mu_);
  Status ApplyRetention(const std::string& job) REQUIRES(commit_mu_);
  // True if a version whose directory is on the tree reads unchanged items from `version`
  // (a ref.* file in its directory: daemon/pipeline/differential.h); removes the references
  // of versions whose directories are gone.
  bool ReferencedAsBase(const std::string& job, std::uint64_t version) REQUIRES(commit_mu_);
  // Renames a version's directory out of the tree (a tombstone), then removes it and what is
  // in it.
  Status RemoveVersionDir(const std::string& job, std::uint64_t version) REQUIRES(commit_mu_);
  // Removes `dir` and the files in it (NotFound: nothing to do).
  Status RemoveTree(const std::string& dir) REQUIRES(commit_mu_);
  // Removes the tombstones of deletions a crash cut short, reporting what it cannot.
  void RemoveTombstones(const std::string& job) REQUIRES(commit_mu_);
  void Report(const std::string& message);

  std::shared_ptr<Storage> storage_;
  const CheckpointTree tree_;
  const std::string node_;          // this node's part of marker names
  const std::string marker_owner_;  // node_ + "-" + 8 random hex digits
  // keep_last in the high half, keep_every in the low one: a reload changes both at once
  // without taking commit_mu_ (held across a commit's disk flushes).
  std::atomic<std::uint64_t> retention_;
  // Commits and rollbacks do I/O (fdatasync, fsync) and are serialised by commit_mu_;
  // latest_mu_ guards only the cache, so Snapshot calls asking Latest() never wait for a
  // commit's disk flushes.
  Mutex commit_mu_;
  Mutex latest_mu_ ACQUIRED_AFTER(commit_mu_);
  // Cache; loaded from storage on first use.
  std::map<std::string, std::uint64_t> latest_ GUARDED_BY(latest_mu_);
  // Counts, per job, the writes of what this daemon learnt first-hand (a commit, a rollback, recovery),
  // so that RefreshLatest, whose scan of the job directory runs unlocked, does not replace a
  // value set while it scanned with what the scan saw before (a version committed meanwhile
  // would be forgotten until the next commit).
  std::map<std::string, std::uint64_t> latest_writes_ GUARDED_BY(latest_mu_);
  std::multiset<std::pair<std::string, std::uint64_t>> pinned_ GUARDED_BY(commit_mu_);
  // Jobs whose `latest` file a failed write left stale; any_stale_ lets RepairLatest return
  // at once without the lock when there is none.
  std::set<std::string> stale_latest_ GUARDED_BY(commit_mu_);
  std::atomic<bool> any_stale_{false};
  const Reporter report_;
  std::unique_ptr<VersionIndexWriter> index_writer_;  // set before use, then read only
};

}  // namespace ckpt
