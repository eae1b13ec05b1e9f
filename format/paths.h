// Names of the files and directories of the checkpoint tree:
//
//   ROOT/JOB/v0000000042/rank-00003.safetensors   one shard per (version, rank)
//   ROOT/JOB/v0000000042/COMMITTED                written last, once every rank is durable
//   ROOT/JOB/latest                               text: the newest committed version
//   ROOT/JOB/set-aside/v0000000050/               versions set aside by a rollback
//
// Files being written carry a ".tmp" suffix until they are renamed into place.
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

std::string VersionDirName(std::uint64_t version);  // "v0000000042"
std::string ShardFileName(std::uint32_t rank);      // "rank-00003.safetensors"
// Parses "v0000000042" (any number of digits); nullopt for anything else.
std::optional<std::uint64_t> ParseVersionDirName(std::string_view name);
// Parses "rank-00003.safetensors"; nullopt for anything else.
std::optional<std::uint32_t> ParseShardFileName(std::string_view name);

}  // namespace ckpt
