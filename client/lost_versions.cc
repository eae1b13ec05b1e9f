#include "client/lost_versions.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace ckpt {
namespace {

// The level `rank` has reached in `version` by what the daemon finds on storage.
Level LevelOnStorage(const v1::VersionInfo& v, std::uint32_t rank) {
  auto has = [rank](const auto& ranks) { return std::find(ranks.begin(), ranks.end(), rank) != ranks.end(); };
  if (v.committed()) return Level::kCommitted;
  if (has(v.durable_ranks())) return Level::kPersisted;
  if (has(v.local_ranks())) return Level::kLocal;
  if (has(v.memory_ranks())) return Level::kCaptured;
  return Level::kNone;
}

// What a version lost to a restart did not become, by the level it had reached.
std::string LostPhrase(std::uint64_t version, Level reached) {
  const std::string v = "version " + std::to_string(version);
  if (reached < Level::kCaptured) return v + " was not captured";
  if (reached < Level::kPersisted) return v + " was not made durable";
  return v + " was not committed";
}

}  // namespace

void LostVersions::AddSession(const std::map<std::uint64_t, Level>& versions) {
  // A committed one is kept too (nothing to report), so that a wait on it still returns.
  for (const auto& [v, reached] : versions) lost_[v] = Lost{reached, reached >= Level::kCommitted};
  while (lost_.size() > kVersionsTracked) lost_.erase(lost_.begin());
}

void LostVersions::AddReported(std::uint64_t version) { lost_[version] = Lost{Level::kNone, true}; }

void LostVersions::Forget(std::uint64_t version) { lost_.erase(version); }

void LostVersions::Clear() { lost_.clear(); }

bool LostVersions::Contains(std::uint64_t version) const { return lost_.count(version) != 0; }

Level LostVersions::Reached(std::uint64_t version) const { return lost_.at(version).reached; }

bool LostVersions::HasUnreported() const {
  for (const auto& [v, l] : lost_) {
    if (!l.reported && l.reached < Level::kCommitted) return true;
  }
  return false;
}

std::string LostVersions::UnreportedList() const {
  std::string out;
  for (const auto& [v, l] : lost_) {
    if (l.reported || l.reached >= Level::kCommitted) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(v);
  }
  return out;
}

void LostVersions::NoteListing(const google::protobuf::RepeatedPtrField<v1::VersionInfo>& listed,
                               std::uint32_t rank) {
  for (const auto& v : listed) {
    auto it = lost_.find(v.version());
    if (it == lost_.end()) continue;
    it->second.reached = std::max(it->second.reached, LevelOnStorage(v, rank));
    if (it->second.reached >= Level::kCommitted) it->second.reported = true;  // not lost after all
  }
}

std::optional<DaemonRestartedError> LostVersions::Report(std::optional<std::uint64_t> first,
                                                         const std::string& note) {
  std::vector<std::uint64_t> named;
  std::string msg;
  auto add = [&](std::uint64_t v, Lost& l) {
    msg += (msg.empty() ? "daemon restarted; " : "; ") + LostPhrase(v, l.reached);
    named.push_back(v);
    l.reported = true;
  };
  if (first) add(*first, lost_.at(*first));
  for (auto& [v, l] : lost_) {
    if (!l.reported && l.reached < Level::kCommitted) add(v, l);
  }
  if (named.empty()) return std::nullopt;
  std::sort(named.begin(), named.end());
  return DaemonRestartedError(msg + " (" + note + ")", std::move(named));
}

}  // namespace ckpt
