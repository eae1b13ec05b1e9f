// Recovery at start-up: every job under the root loses the temporary files an earlier run
// left, and its `latest` is made to name its newest committed version.
#include "daemon/catalog/catalog.h"

#include <spdlog/spdlog.h>

#include <optional>

#include "common/names.h"
#include "common/strings.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

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

}  // namespace ckpt
