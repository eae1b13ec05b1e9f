// Names of the files and directories of the checkpoint tree:
//
//   ROOT/JOB/v0000000042/rank-00003.safetensors   one shard per (version, rank)
//   ROOT/JOB/v0000000042/COMMITTED                written last, once every rank is durable
//   ROOT/JOB/latest                               text: the newest committed version
//   ROOT/JOB/set-aside/v0000000050/               versions set aside by a rollback
//   ROOT/JOB/v0000000042/rank-00003.done          the rank's shard is durable here (holds the
//                                                 registration that wrote it)
//   ROOT/JOB/ranks/rank-00003                     the rank's current registration
//
// Files being written carry a ".tmp" suffix until they are renamed into place; a daemon
// names its own ".NODE.tmp" (TmpSuffix()), so that a daemon restarting on one node removes
// only its own leftovers from the directory all nodes share.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ckpt {

inline constexpr std::string_view kCommittedMarker = "COMMITTED";
inline constexpr std::string_view kLatestFile = "latest";
inline constexpr std::string_view kSetAsideDir = "set-aside";
inline constexpr std::string_view kTmpSuffix = ".tmp";
inline constexpr std::string_view kRanksDir = "ranks";

// The suffix of files this process writes before renaming them: ".tmp", or ".OWNER.tmp"
// once SetTmpOwner(OWNER) was called (once, at daemon start, before any file is written).
const std::string& TmpSuffix();
void SetTmpOwner(const std::string& owner);

std::string VersionDirName(std::uint64_t version);  // "v0000000042"
std::string ShardFileName(std::uint32_t rank);      // "rank-00003.safetensors"
std::string DoneFileName(std::uint32_t rank);       // "rank-00003.done"
std::string RankFileName(std::uint32_t rank);       // "rank-00003"
// Parses "v0000000042" (any number of digits); nullopt for anything else.
std::optional<std::uint64_t> ParseVersionDirName(std::string_view name);
// Parses "rank-00003.safetensors"; nullopt for anything else.
std::optional<std::uint32_t> ParseShardFileName(std::string_view name);

}  // namespace ckpt
