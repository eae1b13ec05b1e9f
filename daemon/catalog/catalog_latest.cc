// The newest committed version of each job: the cache readers ask (Latest), the scan of
// COMMITTED markers it is loaded from, and the `latest` file, a pointer for people and
// outside tools, written after each commit and repaired when a write failed (catalog.h).
#include "daemon/catalog/catalog.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

Result<std::uint64_t> Catalog::ScanLatest(const std::string& job) {
  std::uint64_t newest = 0;
  auto names = storage_->List(JobDir(job));
  if (!names.ok()) return names.status();
  for (const auto& name : names.value()) {
    auto v = ParseVersionDirName(name);
    if (v && *v > newest && storage_->Exists(tree_.CommittedMarker(job, *v))) {
      newest = *v;
    }
  }
  return newest;
}

Status Catalog::WriteLatest(const std::string& job, std::uint64_t version) {
  if (version == 0) return storage_->Remove(tree_.LatestFile(job));
  return storage_->WriteFileAtomic(tree_.LatestFile(job), RenderLatest(version));
}

void Catalog::PublishLatest(const std::string& job, std::uint64_t version) {
  {
    MutexLock lock(latest_mu_);
    latest_[job] = version;
    ++latest_writes_[job];
  }
  Status s = WriteLatest(job, version);
  if (s.ok()) {
    if (stale_latest_.erase(job) != 0) {
      spdlog::info("job {}: 'latest' repaired, names version {}", job, version);
      any_stale_ = !stale_latest_.empty();
    }
    return;
  }
  NoteStaleLatest(job, version, s);
}

void Catalog::NoteStaleLatest(const std::string& job, std::uint64_t version, const Status& s) {
  if (!stale_latest_.insert(job).second) {
    spdlog::debug("job {}: 'latest' still not rewritten: {}", job, s.message());
    return;  // reported when it first failed
  }
  any_stale_ = true;
  Report("job " + job + ": " + tree_.LatestFile(job) + " could not be updated to " + std::to_string(version) +
         " (" + s.message() + "); version " + std::to_string(version) +
         " is committed all the same (its COMMITTED is durable, and restores and loaders take the "
         "newest COMMITTED); the file is rewritten at the next commit or within a second once storage "
         "allows");
}

void Catalog::RepairLatest() {
  if (!any_stale_) return;
  MutexLock lock(commit_mu_);
  const std::set<std::string> stale = stale_latest_;
  // The truth is on storage: another node's daemon may have committed since. A scan that
  // fails (the directory cannot be listed now) repairs nothing and the job stays stale; and
  // a repair never moves the pointer below what this daemon knows is committed.
  for (const auto& job : stale) {
    auto scanned = ScanLatest(job);
    if (!scanned.ok()) continue;
    std::uint64_t known = 0;
    {
      MutexLock cache(latest_mu_);
      if (auto it = latest_.find(job); it != latest_.end()) known = it->second;
    }
    PublishLatest(job, std::max(scanned.value(), known));
  }
}

std::size_t Catalog::stale_latest() {
  MutexLock lock(commit_mu_);
  return stale_latest_.size();
}

std::uint64_t Catalog::Latest(const std::string& job) {
  {
    MutexLock lock(latest_mu_);
    auto it = latest_.find(job);
    if (it != latest_.end()) return it->second;
  }
  auto scanned = ScanLatest(job);
  if (!scanned.ok()) return 0;  // no such job, or not listable now: nothing to cache
  MutexLock lock(latest_mu_);
  return latest_.emplace(job, scanned.value()).first->second;
}

std::size_t Catalog::cached_jobs() {
  MutexLock lock(latest_mu_);
  return latest_.size();
}

void Catalog::NoteCommitted(const std::string& job, std::uint64_t version) {
  MutexLock lock(latest_mu_);
  auto& v = latest_[job];
  v = std::max(v, version);
  ++latest_writes_[job];
}

std::uint64_t Catalog::RefreshLatest(const std::string& job) {
  std::uint64_t writes_before;
  {
    MutexLock lock(latest_mu_);
    auto it = latest_writes_.find(job);  // find: a List of any id must not grow the map
    writes_before = it == latest_writes_.end() ? 0 : it->second;
  }
  auto scanned = ScanLatest(job);
  if (!scanned.ok()) {
    MutexLock lock(latest_mu_);
    if (!storage_->Exists(JobDir(job))) {
      latest_.erase(job);  // gone (or never there): a List of any id must not grow the cache
      latest_writes_.erase(job);
      return 0;
    }
    auto it = latest_.find(job);
    return it == latest_.end() ? 0 : it->second;  // not listable now: what was known stands
  }
  MutexLock lock(latest_mu_);
  if (auto w = latest_writes_.find(job); w != latest_writes_.end() && w->second != writes_before) {
    // Something this daemon did while the scan ran is newer than the scan.
    auto it = latest_.find(job);
    if (it != latest_.end()) return it->second;
  }
  latest_[job] = scanned.value();
  return scanned.value();
}

}  // namespace ckpt
