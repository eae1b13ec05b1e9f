#include "daemon/tiers/local_tier.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/names.h"

namespace ckpt {

Result<std::unique_ptr<LocalTier>> LocalTier::Open(std::shared_ptr<Storage> storage, const std::string& root,
                                                   DirectIoMode mode, std::uint32_t keep, Catalog& catalog) {
  {
    // Only *.tmp leftovers to remove: the local tier has no COMMITTED or latest of its own.
    Catalog leftovers(storage, root);
    if (Status s = leftovers.Recover(); !s.ok()) return s;
  }
  const bool direct_ok = storage->SupportsDirectIo(root);
  if (mode == DirectIoMode::kOn && !direct_ok) {
    return FailedPrecondition(root + " does not accept O_DIRECT writes (--direct-io on)");
  }
  const bool direct = mode != DirectIoMode::kOff && direct_ok;
  return std::unique_ptr<LocalTier>(new LocalTier(std::move(storage), root, direct, keep, catalog));
}

void LocalTier::Pin(const std::string& job, std::uint64_t version) {
  MutexLock lock(pins_mu_);
  pins_.insert({job, version});
}

void LocalTier::Unpin(const std::string& job, std::uint64_t version) {
  MutexLock lock(pins_mu_);
  if (auto it = pins_.find({job, version}); it != pins_.end()) pins_.erase(it);
}

bool LocalTier::Pinned(const std::string& job, std::uint64_t version) const {
  MutexLock lock(pins_mu_);
  return pins_.count({job, version}) != 0;
}

void LocalTier::RemoveVersion(const std::string& job, std::uint64_t version) {
  const std::string vdir = tree_.VersionDir(job, version);
  if (auto files = storage_->List(vdir); files.ok()) {
    for (const auto& f : files.value()) storage_->Remove(JoinPath(vdir, f));
  }
  if (Status st = storage_->Remove(vdir); !st.ok())
    spdlog::warn("local tier: cannot remove {}: {}", vdir, st.message());
}

void LocalTier::ApplyRetention(const std::string& job) {
  MutexLock retention(retention_mu_);
  auto names = storage_->List(tree_.JobDir(job));
  if (!names.ok()) return;
  std::vector<std::uint64_t> versions;
  for (const auto& n : names.value()) {
    if (auto v = ParseVersionDirName(n)) versions.push_back(*v);
  }
  std::sort(versions.rbegin(), versions.rend());  // newest first
  std::uint32_t kept = 0;
  bool seen_committed = false;
  for (std::uint64_t v : versions) {
    bool drop = false;
    if (catalog_.IsCommitted(job, v)) {
      seen_committed = true;
      drop = ++kept > keep_;
    } else {
      // Older than a committed version, it may still commit (versions commit out of order),
      // but only through the persistent tier: its shards still being written or promoted
      // are pinned (from admission to promotion), the rest are promoted already.
      drop = seen_committed;
    }
    if (drop && !Pinned(job, v)) RemoveVersion(job, v);  // a pinned one goes in a later pass
  }
}

void LocalTier::ApplyRetentionToAll() {
  auto jobs = storage_->List(root());
  if (!jobs.ok()) return;
  for (const auto& job : jobs.value()) {
    if (CheckJobId(job).empty()) ApplyRetention(job);
  }
}

std::map<std::string, LocalTier::JobUsage> LocalTier::Usage() const {
  std::map<std::string, JobUsage> out;
  auto jobs = storage_->List(root());
  if (!jobs.ok()) return out;
  for (const auto& job : jobs.value()) {
    if (!CheckJobId(job).empty()) continue;
    for (const auto& [version, ranks] : List(job)) {
      for (std::uint32_t rank : ranks) {
        auto size = storage_->FileSize(ShardPath(job, version, rank));
        if (!size.ok()) continue;
        JobUsage& u = out[job];
        ++u.shards;
        u.bytes += size.value();
      }
    }
  }
  return out;
}

std::map<std::uint64_t, std::vector<std::uint32_t>> LocalTier::List(const std::string& job) const {
  std::map<std::uint64_t, std::vector<std::uint32_t>> out;
  auto names = storage_->List(tree_.JobDir(job));
  if (!names.ok()) return out;
  for (const auto& n : names.value()) {
    auto version = ParseVersionDirName(n);
    if (!version) continue;
    auto files = storage_->List(tree_.VersionDir(job, *version));
    if (!files.ok()) continue;
    std::vector<std::uint32_t>& ranks = out[*version];
    for (const auto& f : files.value()) {
      if (auto r = ParseShardFileName(f)) ranks.push_back(*r);
    }
    std::sort(ranks.begin(), ranks.end());
  }
  return out;
}

Result<std::vector<LocalTier::Uncommitted>> LocalTier::ScanUncommitted() {
  std::vector<Uncommitted> out;
  auto jobs = storage_->List(root());
  if (!jobs.ok()) return jobs.status();
  for (const auto& job : jobs.value()) {
    if (!CheckJobId(job).empty()) continue;
    catalog_.RefreshLatest(job);
    for (const auto& [version, ranks] : List(job)) {
      // Uncommitted versions only; older ones than `latest` may still commit.
      if (catalog_.IsCommitted(job, version)) continue;
      for (std::uint32_t rank : ranks) {
        const std::string path = ShardPath(job, version, rank);
        auto info = ReadShardHeader(path);
        if (!info.ok() || info->meta.job != job || info->meta.version != version || info->meta.rank != rank) {
          spdlog::warn("local tier: {} is not a valid shard ({}); removed", path,
                       info.ok() ? "its metadata names another place" : info.status().message());
          storage_->Remove(path);
          continue;
        }
        out.push_back(Uncommitted{info->meta, path, info->file_bytes});
      }
    }
  }
  return out;
}

}  // namespace ckpt
