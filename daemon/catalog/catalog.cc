#include "daemon/catalog/catalog.h"
#include "common/strings.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <ctime>
#include <random>

#include "common/names.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {
namespace {

// The node's part of marker names: `node`, else the owner of this process's temporary files
// (".OWNER.tmp"), in the characters a marker name allows and short enough to leave room.
std::string MarkerNode(std::string node) {
  if (node.empty()) {
    const std::string& tmp = TmpSuffix();
    if (tmp.size() > 1 + kTmpSuffix.size()) node = tmp.substr(1, tmp.size() - 1 - kTmpSuffix.size());
  }
  if (node.empty()) node = "node";
  for (char& c : node) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '_';
  }
  constexpr std::size_t kRoom = kMaxMarkerOwnerBytes - 9;  // "-" and 8 hex digits follow
  if (node.size() > kRoom) node.resize(kRoom);
  return node;
}

std::string MarkerOwner(const std::string& node) {
  std::random_device rd;
  char buf[16];
  std::snprintf(buf, sizeof buf, "-%08x", static_cast<unsigned>(rd()));
  return node + buf;
}

}  // namespace

Catalog::Catalog(std::shared_ptr<Storage> storage, std::string root, std::uint32_t keep_last,
                 std::uint32_t keep_every, Reporter report, std::string node)
    : storage_(std::move(storage)),
      tree_(std::move(root)),
      node_(MarkerNode(std::move(node))),
      marker_owner_(MarkerOwner(node_)),
      retention_(std::uint64_t{keep_last} << 32 | keep_every),
      report_(std::move(report)) {}

void Catalog::EnableVersionIndex() { index_writer_ = std::make_unique<VersionIndexWriter>(*storage_, tree_); }

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
                                 bool* committed, std::uint64_t* claimed) {
  MutexLock lock(commit_mu_);
  *committed = false;
  if (claimed != nullptr) *claimed = 0;
  if (world_size == 0) return InvalidArgument("cannot commit a version of a job with world size 0");
  const std::string dir = VersionDir(job, version);
  const std::string marker = tree_.CommittedMarker(job, version);
  // One listing says whether it is committed and how many ranks the markers claim (their
  // names count them); the markers are opened only once they may claim every rank.
  auto names = storage_->List(dir);
  if (!names.ok()) return Status::Ok();
  std::uint64_t named = 0;
  std::vector<std::string> markers;
  for (const auto& n : names.value()) {
    if (n == kCommittedMarker) {
      *committed = true;
      return Status::Ok();
    }
    if (auto id = ParseNodeMarkerName(n)) {
      named += id->ranks;
      markers.push_back(n);
    }
  }
  if (claimed != nullptr) *claimed = named;
  if (named < world_size) return Status::Ok();
  auto current = CurrentRegistrationsIfClaimed(job, version, markers, NodeMarkerKind::kDone, world_size);
  if (!current) return Status::Ok();
  if (index_writer_) {
    std::vector<std::string> registrations(world_size);
    for (std::uint32_t r = 0; r < world_size; ++r) registrations[r] = current->at(r);
    if (Status s = index_writer_->Write(job, version, world_size, registrations); !s.ok()) return s;
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

std::optional<NodeClaims> Catalog::CurrentRegistrationsIfClaimed(const std::string& job, std::uint64_t version,
                                                                 const std::vector<std::string>& markers,
                                                                 NodeMarkerKind kind, std::uint32_t world_size) {
  const std::string dir = VersionDir(job, version);
  // Two markers of one daemon may both be listed (a replacement not yet removed), and a
  // rank may be claimed by an earlier run's marker too: every claim counts, the rank's
  // current registration decides which one holds.
  std::vector<std::vector<std::string>> claims(world_size);
  std::uint32_t covered = 0;
  for (const auto& m : markers) {
    const std::string path = JoinPath(dir, m);
    auto text = storage_->ReadSmallFile(path);
    if (!text.ok()) continue;  // replaced by a larger one meanwhile: the next try reads that
    auto parsed = ParseNodeMarker(text.value());
    if (!parsed) {
      spdlog::warn("job {} version {}: {} is not a {} marker (ignored)", job, version, path,
                   kind == NodeMarkerKind::kDone ? "node" : "replica");
      continue;
    }
    for (auto& [rank, registration] : *parsed) {
      if (rank >= world_size) continue;
      if (claims[rank].empty()) ++covered;
      claims[rank].push_back(std::move(registration));
    }
  }
  if (covered < world_size) return std::nullopt;
  auto registered = storage_->List(tree_.RanksDir(job));
  if (!registered.ok()) return std::nullopt;
  // A rank's current registration is its highest generation; two of one generation (two
  // registrations of the rank at once) leave it without one until it registers again.
  struct Current {
    std::uint64_t generation = 0;
    const std::string* registration = nullptr;
    bool tied = false;
  };
  std::vector<Current> current(world_size);
  std::vector<RegistrationId> ids;
  ids.reserve(registered.value().size());
  for (const auto& n : registered.value()) {
    if (auto id = ParseRegistrationName(n); id && id->rank < world_size) ids.push_back(std::move(*id));
  }
  for (const auto& id : ids) {
    Current& c = current[id.rank];
    if (c.registration == nullptr || id.generation > c.generation) {
      c = {id.generation, &id.registration, false};
    } else if (id.generation == c.generation && id.registration != *c.registration) {
      c.tied = true;
    }
  }
  NodeClaims out;
  for (std::uint32_t r = 0; r < world_size; ++r) {
    const Current& c = current[r];
    if (c.registration == nullptr || c.tied ||
        std::find(claims[r].begin(), claims[r].end(), *c.registration) == claims[r].end()) {
      spdlog::debug("job {} version {}: rank {}'s shard is not from its current registration", job, version, r);
      return std::nullopt;
    }
    out.emplace_hint(out.end(), r, *c.registration);
  }
  return out;
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
  const std::string dir = tree_.RanksDir(job);
  const std::string record_path = tree_.RankFile(job, rank);
  RankRecord previous;
  Status s = storage_->MakeDirs(dir);
  if (s.ok()) {
    if (auto text = storage_->ReadSmallFile(record_path); text.ok()) {
      if (auto parsed = ParseRankRecord(text.value())) previous = std::move(*parsed);
    } else if (text.status().code() != StatusCode::kNotFound) {
      s = text.status();
    }
  }
  const RegistrationId next{rank, previous.generation + 1, registration};
  // The record first: a registration that fails after it has used its generation, so the
  // next one goes above any name this one may have left.
  if (s.ok()) s = storage_->WriteFileAtomic(record_path, RenderRankRecord({next.generation, registration}));
  if (s.ok()) s = storage_->WriteFileAtomic(tree_.RegistrationPath(job, next), registration);
  if (!s.ok()) {
    Report("job " + job + " rank " + std::to_string(rank) +
           ": a registration (or restore) failed: it could not be recorded: " + s.message());
    return s;
  }
  if (previous.generation > 0) {
    // A name left (this fails, or a crash) is of a lower generation, which never counts.
    const std::string old = tree_.RegistrationPath(job, {rank, previous.generation, previous.registration});
    if (Status removed = storage_->Remove(old); !removed.ok() && removed.code() != StatusCode::kNotFound) {
      spdlog::debug("job {} rank {}: the replaced registration {} stays: {}", job, rank, old,
                    removed.message());
    }
  }
  return Status::Ok();
}

Status Catalog::WriteNodeMarker(const std::string& job, std::uint64_t version, const NodeClaims& claims,
                                std::uint64_t replaces, NodeMarkerKind kind) {
  const std::string marker = tree_.NodeMarker(job, version, marker_owner_, claims.size(), kind);
  Status s = storage_->WriteFileAtomic(marker, RenderNodeMarker(claims));
  if (!s.ok()) {
    // A marker that got its name before the failure (its directory's fsync failed) is not
    // known to be durable: its shards are failed, so it must not complete a commit.
    if (storage_->Exists(marker)) {
      if (Status removed = storage_->Remove(marker); !removed.ok()) {
        return Status(s.code(), s.message() + "; the marker could not be removed: " + removed.message());
      }
    }
    return s;
  }
  if (replaces != 0 && replaces != claims.size()) {
    // The replaced marker claims a subset of this one: if it stays, it only repeats claims.
    const std::string old = tree_.NodeMarker(job, version, marker_owner_, replaces, kind);
    if (Status removed = storage_->Remove(old); !removed.ok()) {
      spdlog::debug("job {} version {}: replaced marker {} stays: {}", job, version, old, removed.message());
    }
  }
  return Status::Ok();
}

Status Catalog::DecideRestorable(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                 bool* restorable) {
  *restorable = false;
  if (world_size == 0) return InvalidArgument("a version of a job with world size 0 is never restorable");
  auto names = storage_->List(VersionDir(job, version));
  if (!names.ok()) return names.status().With("list version " + std::to_string(version));
  std::uint64_t named = 0;
  std::vector<std::string> markers;
  for (const auto& n : names.value()) {
    if (n == kCommittedMarker) return Status::Ok();  // the committed version is what restores read
    if (auto id = ParseNodeMarkerName(n, NodeMarkerKind::kReplicated)) {
      named += id->ranks;
      markers.push_back(n);
    }
  }
  if (named < world_size) return Status::Ok();
  auto current = CurrentRegistrationsIfClaimed(job, version, markers, NodeMarkerKind::kReplicated, world_size);
  if (!current) return Status::Ok();
  const RestorableMarker marker{world_size, std::move(*current)};
  const std::string path = tree_.RestorableMarker(job, version);
  // Every daemon whose claim completes the version may write it, each the same contents (the
  // registrations are the ranks' current ones); one of an earlier run with the same number
  // (the job rolled back past it) is replaced.
  if (auto text = storage_->ReadSmallFile(path); text.ok()) {
    if (auto old = ParseRestorable(text.value()); old && old->world_size == marker.world_size &&
                                                  old->registrations == marker.registrations) {
      *restorable = true;
      return Status::Ok();
    }
  }
  if (Status s = storage_->WriteFileAtomic(path, RenderRestorable(marker)); !s.ok()) {
    return s.With("write " + path);
  }
  *restorable = true;
  return Status::Ok();
}

Result<RestorableMarker> Catalog::ReadRestorable(const std::string& job, std::uint64_t version) {
  const std::string path = tree_.RestorableMarker(job, version);
  auto text = storage_->ReadSmallFile(path);
  if (!text.ok()) return text.status();
  auto marker = ParseRestorable(text.value());
  if (!marker) return DataLoss(path + " is not a RESTORABLE marker");
  return std::move(*marker);
}

std::vector<std::uint64_t> Catalog::RestorableNewerThan(const std::string& job, std::uint64_t after) {
  std::vector<std::uint64_t> out;
  auto names = storage_->List(JobDir(job));
  if (!names.ok()) return out;
  for (const auto& n : names.value()) {
    auto v = ParseVersionDirName(n);
    if (v && *v > after && storage_->Exists(tree_.RestorableMarker(job, *v))) out.push_back(*v);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

void Catalog::DropRestorableNewerThan(const std::string& job, std::uint64_t version) {
  for (std::uint64_t v : RestorableNewerThan(job, version)) {
    const std::string path = tree_.RestorableMarker(job, v);
    if (Status s = storage_->Remove(path); !s.ok() && s.code() != StatusCode::kNotFound) {
      Report("job " + job + ": " + path + " of the timeline left by a restore of version " + std::to_string(version) +
             " could not be removed: " + s.message());
    }
  }
}

NodeClaims Catalog::DurableClaims(const std::string& job, std::uint64_t version, const NodeClaims& wanted) {
  NodeClaims out;
  const std::string dir = VersionDir(job, version);
  auto names = storage_->List(dir);
  if (!names.ok()) return out;
  for (const auto& n : names.value()) {
    if (!ParseNodeMarkerName(n)) continue;
    auto text = storage_->ReadSmallFile(JoinPath(dir, n));
    if (!text.ok()) continue;
    auto claims = ParseNodeMarker(text.value());
    if (!claims) continue;
    for (const auto& [rank, registration] : *claims) {
      if (auto it = wanted.find(rank); it != wanted.end() && it->second == registration) out[rank] = registration;
    }
  }
  return out;
}

bool Catalog::HasDoneMarker(const std::string& job, std::uint64_t version, std::uint32_t rank,
                            const std::string& registration) {
  auto names = storage_->List(VersionDir(job, version));
  if (!names.ok()) return false;
  for (const auto& n : names.value()) {
    auto id = ParseNodeMarkerName(n);
    // This node's, of any life of the daemon: node_ and "-" and 8 hex digits.
    if (!id || id->owner.size() != node_.size() + 9 || !id->owner.starts_with(node_ + "-")) continue;
    auto text = storage_->ReadSmallFile(JoinPath(VersionDir(job, version), n));
    if (!text.ok()) continue;
    auto claims = ParseNodeMarker(text.value());
    if (!claims) continue;
    if (auto it = claims->find(rank); it != claims->end() && it->second == registration) return true;
  }
  return false;
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
      if (f == kRestorableMarker) e.restorable = true;
      if (auto r = ParseShardFileName(f)) e.ranks.push_back(*r);
      if (e.aborted.empty() && f.rfind(kAbortedPrefix, 0) == 0 && f.find('.', kAbortedPrefix.size()) == std::string::npos) {
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
