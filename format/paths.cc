#include "format/paths.h"

#include <cstdio>

#include "common/decimal.h"
#include "format/markers.h"

namespace ckpt {
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

std::string RankFileName(std::uint32_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05u", rank);
  return buf;
}

std::optional<std::uint64_t> ParseVersionDirName(std::string_view name) {
  if (name.size() < 2 || name[0] != 'v') return std::nullopt;
  auto v = ParsePaddedDecimal(name.substr(1));
  if (!v || VersionDirName(*v) != name) return std::nullopt;  // only the canonical spelling
  return v;
}

std::string BaseRefName(std::uint64_t referrer, std::string_view owner) {
  return "ref." + VersionDirName(referrer) + "." + std::string(owner);
}

std::optional<std::uint64_t> ParseBaseRefName(std::string_view name) {
  constexpr std::string_view kPrefix = "ref.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  const std::size_t dot = name.find('.');
  if (dot == std::string_view::npos || dot + 1 == name.size()) return std::nullopt;
  const std::string_view owner = name.substr(dot + 1);
  if (owner.size() > kMaxMarkerOwnerBytes || owner.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-") != std::string_view::npos) {
    return std::nullopt;
  }
  return ParseVersionDirName(name.substr(0, dot));
}

std::optional<std::uint32_t> ParseShardFileName(std::string_view name) {
  constexpr std::string_view kPrefix = "rank-";
  constexpr std::string_view kSuffix = ".safetensors";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.substr(0, kPrefix.size()) != kPrefix ||
      name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return std::nullopt;
  }
  auto v = ParsePaddedDecimal(name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size()));
  if (!v || *v > UINT32_MAX || ShardFileName(static_cast<std::uint32_t>(*v)) != name) return std::nullopt;
  return static_cast<std::uint32_t>(*v);
}

namespace {

bool OwnerChars(std::string_view s) {
  if (s.empty() || s.size() > kMaxMarkerOwnerBytes) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
          c == '-')) {
      return false;
    }
  }
  return true;
}

std::string_view MarkerSuffix(NodeMarkerKind kind) {
  return kind == NodeMarkerKind::kReplicated ? ".repl" : ".done";
}

}  // namespace

std::string NodeMarkerName(std::string_view owner, std::uint64_t ranks, NodeMarkerKind kind) {
  return "node-" + std::string(owner) + "." + std::to_string(ranks) + std::string(MarkerSuffix(kind));
}

std::optional<NodeMarkerId> ParseNodeMarkerName(std::string_view name, NodeMarkerKind kind) {
  constexpr std::string_view kPrefix = "node-";
  const std::string_view kSuffix = MarkerSuffix(kind);
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return std::nullopt;
  name = name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  const auto dot = name.find_last_of('.');
  if (dot == std::string_view::npos) return std::nullopt;
  auto ranks = ParseDecimal(name.substr(dot + 1));
  if (!ranks || *ranks == 0 || !OwnerChars(name.substr(0, dot))) return std::nullopt;
  return NodeMarkerId{std::string(name.substr(0, dot)), *ranks};
}

std::string RegistrationName(std::uint32_t rank, std::uint64_t generation, std::string_view registration) {
  return RankFileName(rank) + "." + std::to_string(generation) + "." + std::string(registration);
}

std::optional<RegistrationId> ParseRegistrationName(std::string_view name) {
  constexpr std::string_view kPrefix = "rank-";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const auto dot1 = name.find('.');
  if (dot1 == std::string_view::npos) return std::nullopt;
  const auto dot2 = name.find('.', dot1 + 1);
  if (dot2 == std::string_view::npos) return std::nullopt;
  auto rank = ParsePaddedDecimal(name.substr(kPrefix.size(), dot1 - kPrefix.size()));
  if (!rank || *rank > UINT32_MAX ||
      RankFileName(static_cast<std::uint32_t>(*rank)) != name.substr(0, dot1)) {
    return std::nullopt;
  }
  auto generation = ParseDecimal(name.substr(dot1 + 1, dot2 - dot1 - 1));
  auto registration = ParseRegistration(name.substr(dot2 + 1));
  if (!generation || !registration) return std::nullopt;
  return RegistrationId{static_cast<std::uint32_t>(*rank), *generation, std::move(*registration)};
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

std::string CheckpointTree::NodeMarker(const std::string& job, std::uint64_t version, std::string_view owner,
                                       std::uint64_t ranks, NodeMarkerKind kind) const {
  return JoinPath(VersionDir(job, version), NodeMarkerName(owner, ranks, kind));
}

std::string CheckpointTree::RestorableMarker(const std::string& job, std::uint64_t version) const {
  return JoinPath(VersionDir(job, version), kRestorableMarker);
}

std::string CheckpointTree::UnderReplicatedMarker(const std::string& job, std::uint64_t version) const {
  return JoinPath(VersionDir(job, version), kUnderReplicatedMarker);
}

std::string CheckpointTree::RegistrationPath(const std::string& job, const RegistrationId& id) const {
  return JoinPath(RanksDir(job), RegistrationName(id.rank, id.generation, id.registration));
}

std::string CheckpointTree::CommittedMarker(const std::string& job, std::uint64_t version) const {
  return JoinPath(VersionDir(job, version), kCommittedMarker);
}

std::string CheckpointTree::IndexFile(const std::string& job, std::uint64_t version) const {
  return JoinPath(VersionDir(job, version), kIndexFileName);
}

}  // namespace ckpt
