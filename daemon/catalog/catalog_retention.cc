// Which committed versions stay on the tree: retention after each commit (keep_last,
// keep_every), the pins of versions a restore reads, and a rollback's set-aside of the
// versions newer than the one it returns to.
#include "daemon/catalog/catalog.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/safe_file.h"
#include "common/test_pause.h"
#include "format/paths.h"

namespace ckpt {

Catalog::Retention Catalog::retention() const {
  const std::uint64_t r = retention_.load();
  return {static_cast<std::uint32_t>(r >> 32), static_cast<std::uint32_t>(r)};
}

void Catalog::SetRetention(Retention r) { retention_.store(std::uint64_t{r.keep_last} << 32 | r.keep_every); }

Status Catalog::ApplyRetention(const std::string& job) {
  // Plain copies: clang before 16 cannot capture a structured binding in the lambda below.
  const Retention kept = retention();
  const std::uint32_t keep_last = kept.keep_last, keep_every = kept.keep_every;
  if (keep_last == 0) return Status::Ok();
  RemoveTombstones(job);
  auto versions = List(job);
  if (!versions.ok()) return versions.status();
  // Deletions a crash cut short between retention's two looks for references (below): the
  // version may have been referenced in between by a writer that found it committed, so it
  // is committed again, from the marker's text that DELETING holds; else it goes.
  for (const auto& e : versions.value()) {
    const std::string deleting = JoinPath(VersionDir(job, e.version), kDeletingMarker);
    if (e.committed || !storage_->Exists(deleting)) continue;
    Status s;
    if (!ReferencedAsBase(job, e.version)) {
      s = RemoveVersionDir(job, e.version);
    } else if (auto text = storage_->ReadSmallFile(deleting); !text.ok()) {
      s = text.status();
    } else if (s = storage_->WriteFileAtomic(tree_.CommittedMarker(job, e.version), text.value()); s.ok()) {
      (void)storage_->Remove(deleting);
    }
    if (!s.ok()) {
      Report("job " + job + ": finishing the deletion of version " + std::to_string(e.version) +
             " that a crash cut short failed: " + s.message() + " (retried after the next commit)");
    }
  }
  std::vector<std::uint64_t> committed;
  for (const auto& e : versions.value()) {
    if (e.committed) committed.push_back(e.version);
  }
  if (committed.size() <= keep_last) return Status::Ok();
  committed.resize(committed.size() - keep_last);  // the ones to delete, oldest first
  if (keep_every > 0) {
    std::erase_if(committed, [&](std::uint64_t v) { return v % keep_every == 0; });
  }
  // Newest first: a differential version goes before the base it reads from, so that both
  // can go in one pass.
  for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
    const std::uint64_t v = *it;
    if (pinned_.count({job, v}) != 0) continue;  // being restored; a later commit removes it
    // A base that a version still on the tree reads from stays (daemon/pipeline/differential.h).
    if (ReferencedAsBase(job, v)) continue;
    const std::string marker = tree_.CommittedMarker(job, v);
    const std::string deleting = JoinPath(VersionDir(job, v), kDeletingMarker);
    auto marker_text = storage_->ReadSmallFile(marker);
    if (!marker_text.ok()) {
      // Gone meanwhile, or unreadable: this version is left to the next retention.
      Report("job " + job + ": retention skips version " + std::to_string(v) + ": " + marker_text.status().message());
      continue;
    }
    // DELETING first, holding the commit marker's text, so that a crash from here on leaves a
    // deletion the next retention finishes or undoes (above); then the commit marker: a
    // version half deleted is then simply not committed.
    if (Status s = storage_->WriteFileAtomic(deleting, marker_text.value()); !s.ok()) return s;
    if (Status s = storage_->Remove(marker); !s.ok()) return s;
    // A daemon may have referenced it as a base after the look above, and found it still
    // committed: it stays, committed again.
    if (TestPause("retention-delete", v); ReferencedAsBase(job, v)) {
      if (Status s = storage_->WriteFileAtomic(marker, marker_text.value()); !s.ok()) return s;
      (void)storage_->Remove(deleting);
      continue;
    }
    if (Status s = RemoveVersionDir(job, v); !s.ok()) return s;
  }
  return storage_->SyncDir(JobDir(job));
}

Status Catalog::RemoveVersionDir(const std::string& job, std::uint64_t version) {
  // The point of no return: the directory leaves the tree in one rename, so that no writer
  // finds the version (as a base) and no reference from it counts once it starts to go; its
  // files go after, and a crash leaves a tombstone that the next retention removes.
  const std::string tomb =
      JoinPath(JobDir(job), std::string(kTombstonePrefix) + VersionDirName(version) + "." + RandomHex());
  if (Status s = storage_->Rename(VersionDir(job, version), tomb); !s.ok()) return s;
  (void)storage_->SyncDir(JobDir(job));
  return RemoveTree(tomb);
}

Status Catalog::RemoveTree(const std::string& dir) {
  auto files = storage_->List(dir);
  if (!files.ok()) return files.status().code() == StatusCode::kNotFound ? Status::Ok() : files.status();
  for (const auto& f : files.value()) {
    if (Status s = storage_->Remove(JoinPath(dir, f)); !s.ok()) return s;
  }
  return storage_->Remove(dir);
}

void Catalog::RemoveTombstones(const std::string& job) {
  auto names = storage_->List(JobDir(job));
  if (!names.ok()) return;
  for (const auto& n : names.value()) {
    if (!n.starts_with(kTombstonePrefix)) continue;
    if (Status s = RemoveTree(JoinPath(JobDir(job), n)); !s.ok()) {
      Report("job " + job + ": removing " + n + ", a version retention had deleted, failed: " + s.message());
    }
  }
}

bool Catalog::ReferencedAsBase(const std::string& job, std::uint64_t version) {
  // Any doubt (an error other than "not there") counts as a reference: a base kept too long
  // costs space, one deleted too early loses a version.
  auto files = storage_->List(VersionDir(job, version));
  if (!files.ok()) return files.status().code() != StatusCode::kNotFound;
  bool referenced = false;
  for (const auto& f : files.value()) {
    auto referrer = ParseBaseRefName(f);
    if (!referrer) continue;
    auto dir = storage_->List(VersionDir(job, *referrer));
    bool live = dir.ok() || dir.status().code() != StatusCode::kNotFound;
    if (!live) {
      // A rollback sets versions aside (set-aside/vN, or vN.K): those still read from it.
      auto aside = storage_->List(tree_.SetAsideDir(job));
      live = !aside.ok() ? aside.status().code() != StatusCode::kNotFound
                         : std::any_of(aside->begin(), aside->end(), [&](const std::string& n) {
                             const std::string name = VersionDirName(*referrer);
                             return n == name || n.starts_with(name + ".");
                           });
    }
    if (live) {
      referenced = true;
    } else {
      (void)storage_->Remove(JoinPath(VersionDir(job, version), f));  // its version is gone: stale
    }
  }
  return referenced;
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
