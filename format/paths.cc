#include "format/paths.h"

#include <cstdio>

namespace ckpt {
namespace {

std::optional<std::uint64_t> ParseDigits(std::string_view s) {
  if (s.empty() || s.size() > 19) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

}  // namespace

namespace {
std::string& TmpSuffixStorage() {
  static std::string suffix = ".tmp";
  return suffix;
}
}  // namespace

const std::string& TmpSuffix() { return TmpSuffixStorage(); }

void SetTmpOwner(const std::string& owner) { TmpSuffixStorage() = "." + owner + ".tmp"; }

std::string VersionDirName(std::uint64_t version) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "v%010llu", static_cast<unsigned long long>(version));
  return buf;
}

std::string ShardFileName(std::uint32_t rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05u.safetensors", rank);
  return buf;
}

std::string DoneFileName(std::uint32_t rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05u.done", rank);
  return buf;
}

std::string RankFileName(std::uint32_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05u", rank);
  return buf;
}

std::optional<std::uint64_t> ParseVersionDirName(std::string_view name) {
  if (name.size() < 2 || name[0] != 'v') return std::nullopt;
  auto v = ParseDigits(name.substr(1));
  if (!v || VersionDirName(*v) != name) return std::nullopt;  // only the canonical spelling
  return v;
}

std::optional<std::uint32_t> ParseShardFileName(std::string_view name) {
  constexpr std::string_view kPrefix = "rank-";
  constexpr std::string_view kSuffix = ".safetensors";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.substr(0, kPrefix.size()) != kPrefix ||
      name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return std::nullopt;
  }
  auto v = ParseDigits(name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size()));
  if (!v || *v > UINT32_MAX || ShardFileName(static_cast<std::uint32_t>(*v)) != name) return std::nullopt;
  return static_cast<std::uint32_t>(*v);
}

std::string JoinPath(const std::string& dir, std::string_view name) {
  std::string out;
  out.reserve(dir.size() + 1 + name.size());
  out.append(dir).append("/").append(name);
  return out;
}

std::string CheckpointTree::JobDir(const std::string& job) const { return JoinPath(root_, job); }

std::string CheckpointTree::LatestFile(const std::string& job) const {
  return JoinPath(JobDir(job), kLatestFile);
}

std::string CheckpointTree::RanksDir(const std::string& job) const {
  return JoinPath(JobDir(job), kRanksDir);
}

std::string CheckpointTree::RankFile(const std::string& job, std::uint32_t rank) const {
  return JoinPath(RanksDir(job), RankFileName(rank));
}

std::string CheckpointTree::SetAsideDir(const std::string& job) const {
  return JoinPath(JobDir(job), kSetAsideDir);
}

std::string CheckpointTree::OwnerFile(const std::string& job) const {
  return JoinPath(JobDir(job), kOwnerFile);
}

std::string CheckpointTree::VersionDir(const std::string& job, std::uint64_t version) const {
  return JoinPath(JobDir(job), VersionDirName(version));
}

std::string CheckpointTree::ShardPath(const std::string& job, std::uint64_t version,
                                      std::uint32_t rank) const {
  return JoinPath(VersionDir(job, version), ShardFileName(rank));
}

std::string CheckpointTree::DoneMarker(const std::string& job, std::uint64_t version,
                                       std::uint32_t rank) const {
  return JoinPath(VersionDir(job, version), DoneFileName(rank));
}

std::string CheckpointTree::CommittedMarker(const std::string& job, std::uint64_t version) const {
  return JoinPath(VersionDir(job, version), kCommittedMarker);
}

}  // namespace ckpt
