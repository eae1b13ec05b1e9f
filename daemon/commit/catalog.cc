#include "daemon/commit/catalog.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <ctime>

#include "common/names.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {
namespace {

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Catalog::Catalog(std::shared_ptr<Storage> storage, std::string root, std::uint32_t keep_last,
                 std::uint32_t keep_every, Reporter report)
    : storage_(std::move(storage)),
      tree_(std::move(root)),
      retention_(std::uint64_t{keep_last} << 32 | keep_every),
      report_(std::move(report)) {}

Catalog::Retention Catalog::retention() const {
  const std::uint64_t r = retention_.load();
  return {static_cast<std::uint32_t>(r >> 32), static_cast<std::uint32_t>(r)};
}

void Catalog::SetRetention(Retention r) { retention_.store(std::uint64_t{r.keep_last} << 32 | r.keep_every); }

void Catalog::Report(const std::string& message) {
  if (report_) {
    report_(message);  // logs it too
  } else {
    spdlog::error("{}", message);
  }
}

std::string Catalog::JobDir(const std::string& job) const { return tree_.JobDir(job); }

std::string Catalog::VersionDir(const std::string& job, std::uint64_t version) const {
  return tree_.VersionDir(job, version);
}

std::string Catalog::ShardPath(const std::string& job, std::uint64_t version, std::uint32_t rank) const {
  return tree_.ShardPath(job, version, rank);
}

Status Catalog::Recover() {
  if (Status s = storage_->MakeDirs(root()); !s.ok()) return s;
  auto jobs = storage_->List(root());
  if (!jobs.ok()) return jobs.status();
  for (const auto& job : jobs.value()) {
    if (!CheckJobId(job).empty()) continue;  // not ours
    MutexLock lock(commit_mu_);              // recovery rewrites `latest`, as commits do
    if (Status s = RecoverJob(job); !s.ok()) return s.With("recover job " + job);
  }
  return Status::Ok();
}

Status Catalog::RecoverJob(const std::string& job) {
  std::string dir = JobDir(job);
  auto names = storage_->List(dir);
  if (!names.ok()) return Status::Ok();  // vanished meanwhile: nothing to recover
  int removed = 0;
  for (const auto& name : names.value()) {
    if (EndsWith(name, TmpSuffix())) {
      if (Status s = storage_->Remove(JoinPath(dir, name)); !s.ok()) return s;
      ++removed;
      continue;
    }
    if (!ParseVersionDirName(name) && name != kRanksDir) continue;
    auto files = storage_->List(JoinPath(dir, name));
    if (!files.ok()) continue;
    for (const auto& f : files.value()) {
      if (EndsWith(f, TmpSuffix())) {
        if (Status s = storage_->Remove(JoinPath(JoinPath(dir, name), f)); !s.ok()) return s;
        ++removed;
      }
    }
  }
  auto scanned = ScanLatest(job);
  if (!scanned.ok()) return scanned.status();
  const std::uint64_t newest = scanned.value();
  // A `latest` that holds no version number is repaired like a stale one.
  std::optional<std::uint64_t> recorded = 0;
  if (auto text = storage_->ReadSmallFile(tree_.LatestFile(job)); text.ok()) {
    recorded = ParseLatest(text.value());
  }
  if (recorded != newest) {
    spdlog::warn("job {}: 'latest' said {} but the newest committed version is {}; repairing it", job,
                 recorded ? std::to_string(*recorded) : "no version number", newest);
    if (Status s = WriteLatest(job, newest); !s.ok()) {
      // A directory in its place needs a person, and the start stops with the reason. Any
      // other failure (ENOSPC, EROFS, EIO) is a commit's case: `latest` is only a pointer,
      // so it is reported and rewritten later, and the daemon serves: a full or read-only
      // tier must not keep every trainer of the node from reconnecting.
      if (storage_->List(tree_.LatestFile(job)).ok()) return s;
      NoteStaleLatest(job, newest, s);
    }
  }
  if (removed > 0) spdlog::info("job {}: removed {} unfinished temporary file(s)", job, removed);
  MutexLock lock(latest_mu_);
  latest_[job] = newest;
  ++latest_writes_[job];
  return Status::Ok();
}

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

Status Catalog::PrepareVersionDir(const std::string& job, std::uint64_t version) {
  std::string dir = VersionDir(job, version);
  if (storage_->Exists(dir)) return Status::Ok();
  if (Status s = storage_->MakeDirs(dir); !s.ok()) return s;
  if (Status s = storage_->SyncDir(JobDir(job)); !s.ok()) return s;
  return storage_->SyncDir(root());
}

Status Catalog::CommitIfComplete(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                 bool* committed) {
  MutexLock lock(commit_mu_);
  *committed = false;
  if (world_size == 0) return InvalidArgument("cannot commit a version of a job with world size 0");
  std::string dir = VersionDir(job, version);
  std::string marker = tree_.CommittedMarker(job, version);
  if (storage_->Exists(marker)) {
    *committed = true;
    return Status::Ok();
  }
  // Cheap check first (one listing), then the markers' contents, then the registrations.
  auto names = storage_->List(dir);
  if (!names.ok()) return Status::Ok();
  std::uint32_t done = 0;
  for (const auto& n : names.value()) {
    if (n.size() == DoneFileName(0).size() && n.starts_with("rank-") && EndsWith(n, ".done")) ++done;
  }
  if (done < world_size) return Status::Ok();
  std::vector<std::string> writers(world_size);
  for (std::uint32_t r = 0; r < world_size; ++r) {
    auto text = storage_->ReadSmallFile(tree_.DoneMarker(job, version, r));
    if (!text.ok()) return Status::Ok();
    auto writer = ParseRegistration(text.value());
    if (!writer) return Status::Ok();
    writers[r] = *writer;
  }
  for (std::uint32_t r = 0; r < world_size; ++r) {
    auto current = storage_->ReadSmallFile(tree_.RankFile(job, r));
    if (!current.ok() || ParseRegistration(current.value()) != writers[r]) {
      spdlog::debug("job {} version {}: rank {}'s shard is from an earlier registration; not committed", job,
                    version, r);
      return Status::Ok();
    }
  }
  std::string content = RenderCommitted({job, version, world_size, std::time(nullptr)});
  if (Status s = storage_->WriteFileAtomic(marker, content); !s.ok()) {
    // The marker may have its name without being known durable (its directory's fsync
    // failed): it is taken back, so that no reader counts a version its ranks are told failed.
    if (!storage_->Exists(marker)) return s;
    Status removed = storage_->Remove(marker);
    if (removed.ok()) return s;
    // It stays, so readers see the version committed: so is it, and the trouble is reported.
    Report("job " + job + " version " + std::to_string(version) + ": " + s.message() +
           "; the COMMITTED marker could not be taken back (" + removed.message() +
           "), so the version counts as committed");
  }
  *committed = true;
  const std::uint64_t newest = Latest(job);
  if (version >= newest) {
    PublishLatest(job, version);
  } else if (stale_latest_.count(job) != 0) {
    PublishLatest(job, newest);  // an older version committed: a stale pointer is retried
  }
  if (Status s = ApplyRetention(job); !s.ok()) {
    Report("job " + job + ": retention after version " + std::to_string(version) +
           " committed failed: " + s.message() + " (retried after the next commit)");
  }
  return Status::Ok();
}

Status Catalog::ApplyRetention(const std::string& job) {
  // Plain copies: clang before 16 cannot capture a structured binding in the lambda below.
  const Retention kept = retention();
  const std::uint32_t keep_last = kept.keep_last, keep_every = kept.keep_every;
  if (keep_last == 0) return Status::Ok();
  auto versions = List(job);
  if (!versions.ok()) return versions.status();
  std::vector<std::uint64_t> committed;
  for (const auto& e : versions.value()) {
    if (e.committed) committed.push_back(e.version);
  }
  if (committed.size() <= keep_last) return Status::Ok();
  committed.resize(committed.size() - keep_last);  // the ones to delete, oldest first
  if (keep_every > 0) {
    std::erase_if(committed, [&](std::uint64_t v) { return v % keep_every == 0; });
  }
  for (std::uint64_t v : committed) {
    if (pinned_.count({job, v}) != 0) continue;  // being restored; a later commit removes it
    std::string dir = VersionDir(job, v);
    // The marker goes first: a version half deleted is then simply not committed.
    if (Status s = storage_->Remove(tree_.CommittedMarker(job, v)); !s.ok()) return s;
    auto files = storage_->List(dir);
    if (files.ok()) {
      for (const auto& f : files.value()) {
        if (Status s = storage_->Remove(JoinPath(dir, f)); !s.ok()) return s;
      }
    }
    if (Status s = storage_->Remove(dir); !s.ok()) return s;
  }
  return storage_->SyncDir(JobDir(job));
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

Status Catalog::WriteRankRegistration(const std::string& job, std::uint32_t rank,
                                      const std::string& registration) {
  std::string dir = tree_.RanksDir(job);
  Status s = storage_->MakeDirs(dir);
  if (s.ok()) s = storage_->WriteFileAtomic(tree_.RankFile(job, rank), registration);
  if (!s.ok()) {
    Report("job " + job + " rank " + std::to_string(rank) +
           ": a registration (or restore) failed: it could not be recorded: " + s.message());
  }
  return s;
}

Status Catalog::WriteDoneMarker(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                const std::string& registration) {
  const std::string marker = tree_.DoneMarker(job, version, rank);
  Status s = storage_->WriteFileAtomic(marker, registration);
  // A marker that got its name before the failure (its directory's fsync failed) is not
  // known to be durable: the shard is failed, so the marker must not complete a commit.
  if (!s.ok() && storage_->Exists(marker)) {
    if (Status removed = storage_->Remove(marker); !removed.ok()) {
      return Status(s.code(), s.message() + "; the marker could not be removed: " + removed.message());
    }
  }
  return s;
}

bool Catalog::HasDoneMarker(const std::string& job, std::uint64_t version, std::uint32_t rank,
                            const std::string& registration) {
  auto text = storage_->ReadSmallFile(tree_.DoneMarker(job, version, rank));
  return text.ok() && ParseRegistration(text.value()) == registration;
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

bool Catalog::IsCommitted(const std::string& job, std::uint64_t version) {
  return storage_->Exists(tree_.CommittedMarker(job, version));
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
      if (auto r = ParseShardFileName(f)) e.ranks.push_back(*r);
    }
    std::sort(e.ranks.begin(), e.ranks.end());
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.version < b.version; });
  return out;
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

void Catalog::Pin(const std::string& job, std::uint64_t version) {
  MutexLock lock(commit_mu_);
  pinned_.insert({job, version});
}

void Catalog::Unpin(const std::string& job, std::uint64_t version) {
  MutexLock lock(commit_mu_);
  if (auto it = pinned_.find({job, version}); it != pinned_.end()) pinned_.erase(it);
}

Result<int> Catalog::SetAsideNewerThan(const std::string& job, std::uint64_t version) {
  // Listing under the lock: two ranks rolling back at once must not both move a version.
  MutexLock lock(commit_mu_);
  auto versions = List(job);
  if (!versions.ok()) return versions.status();
  std::string aside = tree_.SetAsideDir(job);
  int moved = 0;
  for (const auto& e : versions.value()) {
    if (e.version <= version) continue;
    if (moved == 0) {
      if (Status s = storage_->MakeDirs(aside); !s.ok()) return s;
    }
    std::string target = JoinPath(aside, VersionDirName(e.version));
    for (int n = 1; storage_->Exists(target); ++n) {
      target = JoinPath(aside, VersionDirName(e.version) + "." + std::to_string(n));
    }
    if (Status s = storage_->Rename(VersionDir(job, e.version), target); !s.ok()) {
      // The daemon of another node rolling back the same job moved it first.
      if (!storage_->Exists(VersionDir(job, e.version))) continue;
      if (moved > 0) PublishLatest(job, ScanLatest(job).value_or(version));  // the moved are gone
      return s;
    }
    ++moved;
  }
  if (moved == 0) {
    // Another node's daemon set them aside: follow.
    auto v = ScanLatest(job);
    if (!v.ok()) return v.status();
    MutexLock cache(latest_mu_);
    latest_[job] = v.value();
    ++latest_writes_[job];
    return moved;
  }
  Status synced = storage_->SyncDir(aside);
  if (synced.ok()) synced = storage_->SyncDir(JobDir(job));
  // The versions are moved: the newest committed one is `version` now, whatever `latest` says.
  PublishLatest(job, ScanLatest(job).value_or(version));
  if (!synced.ok()) return synced;
  return moved;
}

}  // namespace ckpt
