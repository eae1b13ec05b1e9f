// Names of the files and directories of the checkpoint tree:
//
//   ROOT/JOB/v0000000042/rank-00003.safetensors   one shard per (version, rank)
//   ROOT/JOB/v0000000042/COMMITTED                written last, once every rank is durable
//   ROOT/JOB/v0000000042/index.json               the version's global tensors, items and blobs
//                                                 (format/version_index.h), written before COMMITTED
//   ROOT/JOB/latest                               text: the newest committed version
//   ROOT/JOB/set-aside/v0000000050/               versions set aside by a rollback
//   ROOT/JOB/v0000000042/node-OWNER.8.done        a daemon's 8 ranks of the version are durable
//                                                 (holds each rank and the registration that wrote it)
//   ROOT/JOB/v0000000042/node-OWNER.8.repl        a daemon's 8 ranks of the version are
//                                                 replicated to peers' memory (same contents)
//   ROOT/JOB/v0000000040/ref.v0000000042.OWNER   version 42 (some of its shards differential,
//                                                 format/shard_format.h) reads unchanged items
//                                                 from this version: retention keeps it
//   ROOT/JOB/v0000000042/DELETING                 retention is deleting the version
//   ROOT/JOB/.deleted.v0000000042.RANDOM          a version retention is removing (a tombstone)
//   ROOT/JOB/v0000000042/RESTORABLE               not committed yet, but every rank's
//                                                 shard is replicated (restorable from memory)
//   ROOT/JOB/ranks/rank-00003.5.REG               the rank's registration REG, its 5th (the highest
//                                                 generation of a rank is its current one)
//   ROOT/JOB/ranks/rank-00003                     the rank's newest generation and registration
//   ROOT/JOB/owner                                the uid the job belongs to (format/job_owner.h)
//
// The node-local tier (--local) has the same tree of version directories and shards, without
// markers, `latest`, ranks/ or set-aside/ (commit happens on the persistent tier only).
//
// Files being written carry a ".tmp" suffix until they are renamed into place; a daemon
// names its own ".NODE.tmp" (TmpSuffix()), so that a daemon restarting on one node removes
// only its own leftovers from the directory all nodes share.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace ckpt {

inline constexpr std::string_view kCommittedMarker = "COMMITTED";
inline constexpr std::string_view kIndexFileName = "index.json";
inline constexpr std::string_view kLatestFile = "latest";
inline constexpr std::string_view kSetAsideDir = "set-aside";
inline constexpr std::string_view kTmpSuffix = ".tmp";
inline constexpr std::string_view kRanksDir = "ranks";
inline constexpr std::string_view kOwnerFile = "owner";
// A version not committed yet whose every rank's shard was replicated to peers'
// memory (format/markers.h, RestorableMarker).
inline constexpr std::string_view kRestorableMarker = "RESTORABLE";
// Retention is deleting the version (written before its COMMITTED is removed): a directory
// with it and without COMMITTED is a deletion a crash cut short, which the next retention
// finishes.
inline constexpr std::string_view kDeletingMarker = "DELETING";
// A version directory retention is removing, renamed out of the tree first:
// ROOT/JOB/.deleted.v0000000042.RANDOM (no reader lists it; the next retention removes it if
// a crash left it).
inline constexpr std::string_view kTombstonePrefix = ".deleted.";
// A version that committed without every rank's shard held by the configured number of peers
// (the replication wait timed out, or a newer version had committed first): its text says
// which ranks were not replicated and why. Written before COMMITTED; for the operator and for
// status, never read by a restore.
inline constexpr std::string_view kUnderReplicatedMarker = "UNDER_REPLICATED";
// A rank aborted the version (its memory changed during the copy): ABORTED.rank-RRRRR holds
// why. Such a version never commits; the file is for the operator (ckptctl ls) and for the
// other ranks' daemons, which stop waiting for it.
inline constexpr std::string_view kAbortedPrefix = "ABORTED.rank-";

// The suffix of files this process writes before renaming them: ".tmp", or ".OWNER.tmp"
// once SetTmpOwner(OWNER) was called (once, at daemon start, before any file is written).
const std::string& TmpSuffix();
void SetTmpOwner(const std::string& owner);

std::string VersionDirName(std::uint64_t version);  // "v0000000042"
std::string ShardFileName(std::uint32_t rank);      // "rank-00003.safetensors"
std::string RankFileName(std::uint32_t rank);       // "rank-00003"
// A daemon's marker of the ranks it persisted of one version: "node-OWNER.RANKS.done". OWNER
// is 1 to kMaxMarkerOwnerBytes of [A-Za-z0-9_-]; RANKS (>= 1, decimal) is how many ranks the
// marker holds, so that a listing of the directory tells how many ranks are claimed.
inline constexpr std::size_t kMaxMarkerOwnerBytes = 160;
// The same name with ".repl" is a daemon's marker of the ranks whose shards of the
// version it replicated to its peers' memory ("node-OWNER.RANKS.repl"), the same contents.
enum class NodeMarkerKind { kDone, kReplicated };
std::string NodeMarkerName(std::string_view owner, std::uint64_t ranks, NodeMarkerKind kind = NodeMarkerKind::kDone);
struct NodeMarkerId {
  std::string owner;
  std::uint64_t ranks = 0;
};
// The canonical spelling of `kind` only; nullopt for anything else.
std::optional<NodeMarkerId> ParseNodeMarkerName(std::string_view name, NodeMarkerKind kind = NodeMarkerKind::kDone);
// A registration of a rank, as a name in JOB/ranks/: "rank-00003.GENERATION.REGISTRATION".
std::string RegistrationName(std::uint32_t rank, std::uint64_t generation, std::string_view registration);
struct RegistrationId {
  std::uint32_t rank = 0;
  std::uint64_t generation = 0;
  std::string registration;
};
// The canonical spelling only, with a valid registration id (format/markers.h); nullopt else.
std::optional<RegistrationId> ParseRegistrationName(std::string_view name);
// Parses "v0000000042", the canonical spelling only (what VersionDirName gives back);
// nullopt for anything else, such as "v42".
std::optional<std::uint64_t> ParseVersionDirName(std::string_view name);
// Parses "rank-00003.safetensors", the canonical spelling only; nullopt for anything else.
std::optional<std::uint32_t> ParseShardFileName(std::string_view name);
// A reference to a base version from a version whose shards a daemon wrote differential,
// in the base's directory: "ref.v0000000042.OWNER" (OWNER as in node markers). Parsing
// gives back the referring version; nullopt for anything else.
std::string BaseRefName(std::uint64_t referrer, std::string_view owner);
std::optional<std::uint64_t> ParseBaseRefName(std::string_view name);

// "dir/name".
std::string JoinPath(const std::string& dir, std::string_view name);

// The paths of one checkpoint tree (drawn above) under `root`: every path of the daemon's
// tiers is built here. Job ids and names are checked by the callers (common/names.h).
class CheckpointTree {
 public:
  explicit CheckpointTree(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }

  std::string JobDir(const std::string& job) const;                        // ROOT/JOB
  std::string LatestFile(const std::string& job) const;                    // ROOT/JOB/latest
  std::string RanksDir(const std::string& job) const;                      // ROOT/JOB/ranks
  std::string RankFile(const std::string& job, std::uint32_t rank) const;  // ROOT/JOB/ranks/rank-R
  std::string SetAsideDir(const std::string& job) const;                   // ROOT/JOB/set-aside
  std::string OwnerFile(const std::string& job) const;                     // ROOT/JOB/owner
  std::string VersionDir(const std::string& job, std::uint64_t version) const;
  std::string ShardPath(const std::string& job, std::uint64_t version, std::uint32_t rank) const;
  std::string NodeMarker(const std::string& job, std::uint64_t version, std::string_view owner,
                         std::uint64_t ranks, NodeMarkerKind kind = NodeMarkerKind::kDone) const;
  std::string RestorableMarker(const std::string& job, std::uint64_t version) const;
  std::string UnderReplicatedMarker(const std::string& job, std::uint64_t version) const;
  std::string RegistrationPath(const std::string& job, const RegistrationId& id) const;
  std::string CommittedMarker(const std::string& job, std::uint64_t version) const;
  std::string IndexFile(const std::string& job, std::uint64_t version) const;

 private:
  std::string root_;
};

}  // namespace ckpt
