// What readers see of the tree: the jobs under the root, a job's versions (committed,
// restorable, aborted, the ranks with a durable shard), the ABORTED markers of versions a
// rank dropped, and the bytes a version holds.
#include "daemon/catalog/catalog.h"

#include <algorithm>
#include <cstdio>

#include "common/names.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

bool Catalog::IsCommitted(const std::string& job, std::uint64_t version) {
  return storage_->Exists(tree_.CommittedMarker(job, version));
}

bool Catalog::HasVersionDir(const std::string& job, std::uint64_t version) {
  return storage_->Exists(VersionDir(job, version));
}

Result<std::map<std::uint32_t, std::string>> Catalog::MarkerClaims(const std::string& job, std::uint64_t version,
                                                                   NodeMarkerKind kind) {
  const std::string dir = VersionDir(job, version);
  auto names = storage_->List(dir);
  if (!names.ok()) return names.status();
  std::map<std::uint32_t, std::string> out;
  for (const auto& n : names.value()) {
    auto id = ParseNodeMarkerName(n, kind);
    if (!id) continue;
    auto text = storage_->ReadSmallFile(JoinPath(dir, n));
    if (!text.ok()) continue;  // replaced by a marker of more ranks meanwhile
    auto claims = ParseNodeMarker(text.value());
    if (!claims) continue;
    for (const auto& [rank, registration] : *claims) out.emplace(rank, id->owner);
  }
  return out;
}

std::string Catalog::MarkerOwnerNode(const std::string& owner) {
  // The owner is the node id, "-" and 8 hex digits of the daemon's start.
  const auto dash = owner.rfind('-');
  return dash == std::string::npos || owner.size() - dash != 9 ? owner : owner.substr(0, dash);
}

Result<std::vector<VersionEntry>> Catalog::List(const std::string& job) {
  std::vector<VersionEntry> out;
  auto names = storage_->List(JobDir(job));
  if (!names.ok()) {
    if (names.status().code() == StatusCode::kNotFound) return out;
    return names.status();
  }
  for (const auto& name : names.value()) {
    auto v = ParseVersionDirName(name);
    if (!v) continue;
    VersionEntry e;
    e.version = *v;
    auto files = storage_->List(JoinPath(JobDir(job), name));
    if (!files.ok()) continue;
    for (const auto& f : files.value()) {
      if (f == kCommittedMarker) e.committed = true;
      if (f == kRestorableMarker) e.restorable = true;
      if (f == kUnderReplicatedMarker) e.under_replicated = UnderReplicated(job, e.version);
      if (auto r = ParseShardFileName(f)) e.ranks.push_back(*r);
      if (e.aborted.empty() && f.rfind(kAbortedPrefix, 0) == 0 &&
          f.find('.', kAbortedPrefix.size()) == std::string::npos) {
        auto text = storage_->ReadSmallFile(JoinPath(JoinPath(JobDir(job), name), f));
        e.aborted = text.ok() && !text.value().empty() ? text.value() : "aborted";
      }
    }
    std::sort(e.ranks.begin(), e.ranks.end());
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.version < b.version; });
  return out;
}

Status Catalog::WriteAborted(const std::string& job, std::uint64_t version, std::uint32_t rank,
                             const std::string& why) {
  if (Status s = PrepareVersionDir(job, version); !s.ok()) return s;
  char name[32];
  std::snprintf(name, sizeof name, "%05u", rank);
  return storage_->WriteFileAtomic(JoinPath(VersionDir(job, version), std::string(kAbortedPrefix) + name),
                                   "rank " + std::to_string(rank) + ": " + why);
}

std::string Catalog::AbortedReason(const std::string& job, std::uint64_t version) {
  auto files = storage_->List(VersionDir(job, version));
  if (!files.ok()) return "";
  for (const auto& f : files.value()) {
    if (f.rfind(kAbortedPrefix, 0) != 0 || f.find('.', kAbortedPrefix.size()) != std::string::npos) continue;
    auto text = storage_->ReadSmallFile(JoinPath(VersionDir(job, version), f));
    return text.ok() && !text.value().empty() ? text.value() : "aborted";
  }
  return "";
}

Result<std::vector<std::string>> Catalog::Jobs() {
  auto names = storage_->List(root());
  if (!names.ok()) return names.status();
  std::vector<std::string> out;
  for (auto& name : names.value()) {
    if (CheckJobId(name).empty()) out.push_back(std::move(name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::uint64_t Catalog::VersionBytes(const std::string& job, const VersionEntry& entry) {
  std::uint64_t bytes = 0;
  for (std::uint32_t rank : entry.ranks) {
    auto size = storage_->FileSize(ShardPath(job, entry.version, rank));
    // Retention may delete a version between the listing and here: it holds nothing now.
    if (!size.ok()) continue;
    bytes += size.value();
  }
  return bytes;
}

}  // namespace ckpt
