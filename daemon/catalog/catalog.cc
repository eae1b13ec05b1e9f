// The commit protocol of the Catalog (catalog.h, at the top): version directories, the
// registrations of ranks (JOB/ranks/), the markers of durable shards (node-OWNER.K.done)
// and COMMITTED, written once the markers claim every rank with its current registration.
#include "daemon/catalog/catalog.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <ctime>
#include <random>

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

Status Catalog::PrepareVersionDir(const std::string& job, std::uint64_t version) {
  std::string dir = VersionDir(job, version);
  if (storage_->Exists(dir)) return Status::Ok();
  if (Status s = storage_->MakeDirs(dir); !s.ok()) return s;
  if (Status s = storage_->SyncDir(JobDir(job)); !s.ok()) return s;
  return storage_->SyncDir(root());
}

Status Catalog::CommitIfComplete(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                 bool* committed, std::uint64_t* claimed, ReplicaGate* gate) {
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
  std::uint64_t named = 0, named_replicated = 0;
  std::vector<std::string> markers, replica_markers;
  for (const auto& n : names.value()) {
    if (n == kCommittedMarker) {
      *committed = true;
      return Status::Ok();
    }
    if (auto id = ParseNodeMarkerName(n)) {
      named += id->ranks;
      markers.push_back(n);
    } else if (auto rid = ParseNodeMarkerName(n, NodeMarkerKind::kReplicated)) {
      named_replicated += rid->ranks;
      replica_markers.push_back(n);
    }
  }
  if (claimed != nullptr) *claimed = named;
  if (named < world_size) return Status::Ok();
  auto current = CurrentRegistrationsIfClaimed(job, version, markers, NodeMarkerKind::kDone, world_size);
  if (!current) return Status::Ok();
  if (gate != nullptr && gate->replicas) {
    if (claimed != nullptr) *claimed = named + named_replicated;
    gate->unreplicated = UnreplicatedRanks(job, version, replica_markers, *current);
    if (!gate->unreplicated.empty()) {
      if (!gate->commit_anyway) return Status::Ok();
      std::string ranks;
      for (std::uint32_t r : gate->unreplicated) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      const std::string text = "ranks " + ranks + ": " + gate->commit_anyway_why + "\n";
      // Before COMMITTED: a version that commits without it would pass for fully replicated.
      if (Status s = storage_->WriteFileAtomic(tree_.UnderReplicatedMarker(job, version), text); !s.ok()) {
        return s.With("write the UNDER_REPLICATED marker");
      }
      gate->under_replicated = true;
    } else if (storage_->Exists(tree_.UnderReplicatedMarker(job, version))) {
      // Left by an earlier attempt whose COMMITTED failed: this commit is fully replicated.
      (void)storage_->Remove(tree_.UnderReplicatedMarker(job, version));
    }
  }
  if (index_writer_) {
    std::vector<std::string> registrations(world_size);
    for (std::uint32_t r = 0; r < world_size; ++r) registrations[r] = current->at(r);
    if (Status s = index_writer_->Write(job, version, world_size, registrations); !s.ok()) return s;
  }
  std::string content = RenderCommitted({job, version, world_size, std::time(nullptr)});
  if (Status s = storage_->WriteFileAtomic(marker, content); !s.ok()) {
    // The marker may have its name without being known durable (its directory's fsync
    // failed): it is taken back, so that no reader counts a version its ranks are told failed.
    if (!storage_->Exists(marker)) {
      if (gate != nullptr && gate->under_replicated) {
        (void)storage_->Remove(tree_.UnderReplicatedMarker(job, version));  // the next try decides again
        gate->under_replicated = false;
      }
      return s;
    }
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

std::vector<std::uint32_t> Catalog::UnreplicatedRanks(const std::string& job, std::uint64_t version,
                                                      const std::vector<std::string>& replica_markers,
                                                      const NodeClaims& current) {
  const std::string dir = VersionDir(job, version);
  NodeClaims replicated;  // only the claims of each rank's current registration count
  for (const auto& m : replica_markers) {
    auto text = storage_->ReadSmallFile(JoinPath(dir, m));
    if (!text.ok()) continue;  // replaced by a larger one meanwhile: the next look reads that
    auto parsed = ParseNodeMarker(text.value());
    if (!parsed) continue;
    for (auto& [rank, registration] : *parsed) {
      auto it = current.find(rank);
      if (it != current.end() && it->second == registration) replicated[rank] = registration;
    }
  }
  std::vector<std::uint32_t> missing;
  for (const auto& [rank, registration] : current) {
    if (!replicated.count(rank)) missing.push_back(rank);
  }
  return missing;
}

std::string Catalog::UnderReplicated(const std::string& job, std::uint64_t version) {
  auto text = storage_->ReadSmallFile(tree_.UnderReplicatedMarker(job, version));
  if (!text.ok()) return "";
  std::string t = text.value();
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  return t.empty() ? "under-replicated" : t;
}

std::optional<NodeClaims> Catalog::CurrentRegistrationsIfClaimed(const std::string& job,
                                                                 std::uint64_t version,
                                                                 const std::vector<std::string>& markers,
                                                                 NodeMarkerKind kind,
                                                                 std::uint32_t world_size) {
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
      spdlog::debug("job {} version {}: rank {}'s shard is not from its current registration", job, version,
                    r);
      return std::nullopt;
    }
    out.emplace_hint(out.end(), r, *c.registration);
  }
  return out;
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
      if (auto it = wanted.find(rank); it != wanted.end() && it->second == registration)
        out[rank] = registration;
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

}  // namespace ckpt
