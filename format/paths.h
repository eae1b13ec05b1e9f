// Names of the files and directories of the checkpoint tree:
//
//   ROOT/JOB/v0000000042/rank-00003.safetensors   one shard per (version, rank)
//   ROOT/JOB/v0000000042/COMMITTED                written last, once every rank is durable
//   ROOT/JOB/latest                               text: the newest committed version
//   ROOT/JOB/set-aside/v0000000050/               versions set aside by a rollback
//   ROOT/JOB/v0000000042/rank-00003.done          the rank's shard is durable here (holds the
//                                                 registration that wrote it)
//   ROOT/JOB/ranks/rank-00003                     the rank's current registration
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
inline constexpr std::string_view kLatestFile = "latest";
inline constexpr std::string_view kSetAsideDir = "set-aside";
inline constexpr std::string_view kTmpSuffix = ".tmp";
inline constexpr std::string_view kRanksDir = "ranks";
inline constexpr std::string_view kOwnerFile = "owner";

// The suffix of files this process writes before renaming them: ".tmp", or ".OWNER.tmp"
// once SetTmpOwner(OWNER) was called (once, at daemon start, before any file is written).
const std::string& TmpSuffix();
void SetTmpOwner(const std::string& owner);

std::string VersionDirName(std::uint64_t version);  // "v0000000042"
std::string ShardFileName(std::uint32_t rank);      // "rank-00003.safetensors"
std::string DoneFileName(std::uint32_t rank);       // "rank-00003.done"
std::string RankFileName(std::uint32_t rank);       // "rank-00003"
// Parses "v0000000042", the canonical spelling only (what VersionDirName gives back);
// nullopt for anything else, such as "v42".
std::optional<std::uint64_t> ParseVersionDirName(std::string_view name);
// Parses "rank-00003.safetensors", the canonical spelling only; nullopt for anything else.
std::optional<std::uint32_t> ParseShardFileName(std::string_view name);

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
  std::string DoneMarker(const std::string& job, std::uint64_t version, std::uint32_t rank) const;
  std::string CommittedMarker(const std::string& job, std::uint64_t version) const;

 private:
  std::string root_;
};

}  // namespace ckpt
