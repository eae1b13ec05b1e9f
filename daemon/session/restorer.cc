#include "daemon/session/restorer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "daemon/metrics/daemon_metrics.h"
#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

namespace {

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// The layout the trainer registered for item i, resolved (none: rank-private). The
// registration checked it (TableLoader), so it resolves.
std::optional<GlobalLayout> RegisteredLayout(const Session& s, std::size_t i) REQUIRES(s.mu) {
  const TableItem& item = s.items[i];
  for (const auto& [name, layout] : s.layouts) {
    if (name != item.name) continue;
    GlobalLayout resolved = layout;
    if (!ResolveLayout(item.name, item.shape, &resolved).ok()) return std::nullopt;
    return resolved;
  }
  return std::nullopt;
}

}  // namespace

Status Restorer::RollBack(Session& s, std::uint64_t v) {
  // Where another daemon of the job rolled it back first, nothing is left to move (the
  // catalog follows), and what remains is this daemon's own part below.
  auto moved = tiers_.persistent().SetAsideNewerThan(s.job, v);
  if (!moved.ok()) return moved.status().With("set aside versions newer than " + std::to_string(v));
  spdlog::info("job {}: rolled back to version {}, {} newer version(s) set aside", s.job, v, moved.value());
  tiers_.memory().DropNewerThan(s.job, s.rank, v);
  // Numbering continues from v: versions above it will be committed (again).
  commits_.RolledBack(s.job, v);
  return Status::Ok();
}

Status Restorer::CheckIdentity(const Session& s, std::uint64_t version, const ShardSource& src,
                               const std::string* registration) {
  ShardMeta meta;
  if (src.image) {
    meta = src.image->meta;
  } else {
    auto info = ReadShardHeader(src.path);
    if (!info.ok()) return info.status();
    meta = info->meta;
  }
  const std::string where = src.image ? std::string("the memory tier's shard") : "shard " + src.path;
  if (meta.world_size != s.world_size && meta.job == s.job && meta.version == version) {
    // The job ran at another world size: the registration does not fit, on any tier.
    return FailedPrecondition(where + " was written by rank " + std::to_string(meta.rank) + " of " +
                              std::to_string(meta.world_size) + " (job '" + meta.job + "'), not rank " +
                              std::to_string(s.rank) + " of " + std::to_string(s.world_size));
  }
  if (meta.job != s.job || meta.version != version || meta.rank != s.rank ||
      meta.world_size != s.world_size) {
    return DataLoss(where + " holds version " + std::to_string(meta.version) + " of rank " +
                    std::to_string(meta.rank) + " of " + std::to_string(meta.world_size) + " (job '" +
                    meta.job + "'), not version " + std::to_string(version) + " of rank " +
                    std::to_string(s.rank) + " of " + std::to_string(s.world_size) +
                    " (was written by another rank or copied into place)");
  }
  if (registration != nullptr && meta.session != *registration) {
    // A version not committed yet (restored from peers' memory) may have copies of two runs
    // under one number: only the one its RESTORABLE marker names is this version.
    return DataLoss(where + " of version " + std::to_string(version) + " was written by registration '" +
                    meta.session + "', not by '" + *registration +
                    "' that its RESTORABLE marker names (a shard of another run of the job)");
  }
  return Status::Ok();
}

Result<RestoredShard> Restorer::ReadCopy(Session& s, std::uint64_t version, const ShardSource& given,
                                         const std::string* registration) {
  ShardSource src = given;
  if (src.tier == Tier::kPeer && !src.image) {
    // A replica in a peer's memory, fetched now; a peer that cannot give it is
    // worth the next source, like a missing copy (NOT_FOUND: "could not be read").
    auto image = tiers_.FetchFromPeer(src, s.job, version, s.rank);
    if (!image.ok()) return NotFound("peer " + src.peer + ": " + image.status().message());
    src.image = std::move(image).value();
  }
  // A peer's replica is another daemon's copy, possibly of another run of the job under the
  // same numbers: one that does not fit this registration (another world size, other items,
  // dtypes or shapes: FailedPrecondition, found before any byte is written) is passed over
  // like a bad copy. The next source, the persistent tier's last, says whether the
  // registration fits the version at all.
  auto misfit = [&](const Status& st) {
    if (src.tier != Tier::kPeer || st.code() != StatusCode::kFailedPrecondition) return st;
    return DataLoss("the replica from peer " + src.peer + " does not fit this registration: " + st.message());
  };
  if (Status st = CheckIdentity(s, version, src, registration); !st.ok()) return misfit(st);
  std::vector<RestoreTarget> targets;
  targets.reserve(s.items.size());
  for (std::size_t i = 0; i < s.items.size(); ++i) {
    const TableItem& t = s.items[i];
    RestoreTarget target;
    target.item.name = t.name;
    target.item.dtype = t.dtype;
    target.item.shape = t.shape;
    target.item.length = t.length;
    target.region = s.item_regions[i];
    target.region_offset = t.offset;
    target.preallocated = std::any_of(s.preallocated.begin(), s.preallocated.end(), [&](const auto& p) {
      return p.region == target.region && p.offset == t.offset && p.length == t.length;
    });
    targets.push_back(std::move(target));
  }
  if (src.tier == Tier::kPeer) {  // a failure names the peer
    auto got = engine_.RestoreFromImage(*src.image, targets);
    if (!got.ok() && got.status().code() == StatusCode::kFailedPrecondition) return misfit(got.status());
    if (!got.ok()) return got.status().With("replica from peer " + src.peer);
    return got;
  }
  return src.image ? engine_.RestoreFromImage(*src.image, targets)
                   : engine_.Restore(src.path, targets, src.direct_io);
}

Result<Restored> Restorer::Restore(Session& s, std::uint64_t requested, const CancelCheck& cancelled) {
  const auto start = std::chrono::steady_clock::now();
  Result<Restored> done = RestoreUncounted(s, requested, cancelled);
  // What the registration allocated served this restore (or its failure wrote some of it):
  // a later one allocates for itself.
  s.preallocated.clear();
  if (done.ok()) {
    // One line per restore says where its time went (bench/recovery.sh reads it).
    spdlog::info(
        "job {} rank {}: restore of version {} from {}: wait {:.1f} ms, plan {:.1f} ms, verify {:.1f} ms "
        "(preallocation beside it {:.1f} ms), copy {:.1f} ms, registration {:.1f} ms, total {:.1f} ms",
        s.job, s.rank, done->version, TierName(done->tier), done->wait_ms, done->plan_ms, done->verify_ms,
        done->preallocate_ms, done->copy_ms, done->registration_ms, MsSince(start));
    metrics::Metrics().Restored(
        done->tier == Tier::kMemory  ? metrics::TierLabel::kMemory
        : done->tier == Tier::kLocal ? metrics::TierLabel::kLocal
        : done->tier == Tier::kPeer  ? metrics::TierLabel::kPeer
                                     : metrics::TierLabel::kPersistent,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  } else if (done.status().code() != StatusCode::kCancelled) {
    metrics::Metrics().Error(metrics::ErrorKind::kRestore);
  }
  return done;
}

Result<std::uint32_t> Restorer::VersionWorldSize(const std::string& job, std::uint64_t v) {
  const std::string path = JoinPath(tiers_.persistent().VersionDir(job, v), kCommittedMarker);
  auto text = engine_.storage()->ReadSmallFile(path);
  if (!text.ok()) return text.status().With("read the world size of version " + std::to_string(v));
  auto marker = ParseCommitted(text.value());
  if (!marker.ok()) return marker.status().With(path);
  return marker->world_size;
}

Result<Restored> Restorer::RestoreOwnShard(Session& s, std::uint64_t v, const std::string* registration,
                                           const ShardSource* fetched) {
  Result<RestoredShard> restored = Status(Internal("no tier to restore from"));
  Tier tier = Tier::kPersistent;
  for (ShardSource src : tiers_.Sources(s.job, v, s.rank, /*ask_peers=*/true, registration)) {
    if (fetched != nullptr && src.tier == Tier::kPeer && src.peer == fetched->peer) src.image = fetched->image;
    tier = src.tier;
    restored = ReadCopy(s, v, src, registration);
    if (restored.ok()) break;
    // Only a bad or missing copy is worth another tier: a registration that does not match
    // the shard (FailedPrecondition) or an unreadable region fails on every tier alike, and
    // IO_ERROR is what the engine reports for a failed write to the trainer's regions (every
    // tier would meet it again, and its copies are good).
    if (!WorthNextCopy(restored.status(), src.tier, /*io_error_is_copy=*/false)) break;
    const StatusCode code = restored.status().code();
    metrics::Metrics().Error(metrics::ErrorKind::kRestoreVerify);
    errors_.Record("job " + s.job + " rank " + std::to_string(s.rank) + " version " + std::to_string(v) +
                   ": the " + TierName(src.tier) + " tier's copy " +
                   (code == StatusCode::kDataLoss ? "failed verification" : "could not be read") + " (" +
                   restored.status().message() + "); dropped, restoring from the next tier");
    tiers_.DropCopy(src);
  }
  if (!restored.ok()) {
    // The engine's message says what the regions hold: untouched, or partly written.
    return restored.status().With("restore version " + std::to_string(v) + " from " + TierName(tier));
  }
  counters_.bytes_read += restored->bytes_read;
  (tier == Tier::kMemory  ? counters_.from_memory
   : tier == Tier::kLocal ? counters_.from_local
   : tier == Tier::kPeer  ? counters_.from_peer
                          : counters_.from_persistent) += restored->tensor_bytes;
  spdlog::info("job {} rank {}: restored version {} from {} ({} bytes, {} read from disk)", s.job, s.rank, v,
               TierName(tier), restored->tensor_bytes, restored->bytes_read);
  Restored out;
  out.version = v;
  out.tier = tier;
  out.tensor_bytes = restored->tensor_bytes;
  out.world_size = s.world_size;
  out.verify_ms = restored->verify_ms;
  out.preallocate_ms = restored->preallocate_ms;
  out.copy_ms = restored->copy_ms;
  for (auto& [name, data] : restored->blobs) out.blobs.push_back({std::move(name), std::move(data), s.rank});
  return out;
}

ElasticRequest Restorer::ElasticRequestOf(const Session& s, std::uint64_t v, std::uint32_t version_world) {
  ElasticRequest req;
  req.job = s.job;
  req.version = v;
  req.version_world_size = version_world;
  req.rank = s.rank;
  req.world_size = s.world_size;
  for (std::size_t i = 0; i < s.items.size(); ++i) {
    const TableItem& t = s.items[i];
    ElasticTarget target;
    target.target.item.name = t.name;
    target.target.item.dtype = t.dtype;
    target.target.item.shape = t.shape;
    target.target.item.length = t.length;
    target.target.region = s.item_regions[i];
    target.target.region_offset = t.offset;
    target.layout = RegisteredLayout(s, i);
    req.targets.push_back(std::move(target));
  }
  return req;
}

Result<Restored> Restorer::RestoreElastic(Session& s, const ElasticRequest& req) {
  auto restored = elastic_.Restore(req);
  if (!restored.ok()) {
    return restored.status().With("restore version " + std::to_string(req.version) + " (written by " +
                                  std::to_string(req.version_world_size) + " ranks) into rank " +
                                  std::to_string(s.rank) + " of " + std::to_string(s.world_size));
  }
  counters_.bytes_read += restored->bytes_read;
  counters_.from_memory += restored->tier_bytes[static_cast<int>(Tier::kMemory)];
  counters_.from_local += restored->tier_bytes[static_cast<int>(Tier::kLocal)];
  counters_.from_persistent += restored->tier_bytes[static_cast<int>(Tier::kPersistent)];
  counters_.from_peer += restored->tier_bytes[static_cast<int>(Tier::kPeer)];
  ++counters_.resharded;
  spdlog::info(
      "job {} rank {} of {}: restored version {} written by {} ranks (resharded; {} bytes: {} from memory, "
      "{} local, {} from peers, {} persistent; {} read from disk)",
      s.job, s.rank, s.world_size, req.version, req.version_world_size, restored->tensor_bytes,
      restored->tier_bytes[static_cast<int>(Tier::kMemory)], restored->tier_bytes[static_cast<int>(Tier::kLocal)],
      restored->tier_bytes[static_cast<int>(Tier::kPeer)], restored->tier_bytes[static_cast<int>(Tier::kPersistent)],
      restored->bytes_read);
  Restored out;
  out.version = req.version;
  out.tier = restored->slowest;
  out.tensor_bytes = restored->tensor_bytes;
  out.world_size = req.version_world_size;
  out.resharded = true;
  out.blobs = std::move(restored->blobs);
  return out;
}

bool Restorer::AllHeld(const std::string& job, std::uint64_t v, const RestorableMarker& marker,
                       std::string* missing) {
  const NodeClaims durable = tiers_.persistent().DurableClaims(job, v, marker.registrations);
  for (const auto& [rank, registration] : marker.registrations) {
    if (durable.count(rank) != 0) continue;
    if (auto image = tiers_.memory().Find(job, v, rank); image && image->meta.session == registration) continue;
    if (tiers_.peers() != nullptr && tiers_.peers()->AnyHolds(job, v, rank, registration)) continue;
    *missing = "rank " + std::to_string(rank) + "'s shard (registration '" + registration +
               "') is held by no live daemon and not persisted";
    return false;
  }
  return true;
}

Result<Restorer::Chosen> Restorer::Choose(Session& s, std::uint64_t requested, bool uncommitted_ok) {
  Catalog& catalog = tiers_.persistent();
  auto held = tiers_.HoldCommitted(s.job, requested);
  const std::uint64_t latest = held.ok() ? held->latest : catalog.Latest(s.job);
  std::string why_not;  // for a version asked for by number that is not taken
  if (uncommitted_ok && tiers_.peers() != nullptr) {
    // With peer replication: a version newer than the newest committed one (or the one asked for, if it is
    // not committed) whose every rank's shard is still in some daemon's memory.
    // Only above the newest committed version: one below it belongs to a timeline a commit
    // already left (or retention is deleting it).
    std::vector<std::uint64_t> candidates;
    if (requested == 0) {
      candidates = catalog.RestorableNewerThan(s.job, latest);
    } else if (!held.ok() && held.status().code() == StatusCode::kNotFound && requested > latest) {
      candidates.push_back(requested);  // read below; a version without RESTORABLE is skipped
    }
    for (std::uint64_t v : candidates) {
      auto marker = catalog.ReadRestorable(s.job, v);
      if (!marker.ok()) {
        if (marker.status().code() != StatusCode::kNotFound) {
          errors_.Record("job " + s.job + " version " + std::to_string(v) + ": " + marker.status().message());
        }
        continue;
      }
      if (marker->world_size != s.world_size) {
        why_not = "version " + std::to_string(v) + " is not committed yet and was written by " +
                  std::to_string(marker->world_size) + " ranks, not " + std::to_string(s.world_size) +
                  ": only a committed version is restored at another world size";
        spdlog::info("job {} rank {}: {}", s.job, s.rank, why_not);
        continue;
      }
      auto hold = std::make_unique<VersionHold>(catalog, tiers_.local(), s.job, v);
      std::string missing;
      if (!AllHeld(s.job, v, marker.value(), &missing)) {
        why_not = "version " + std::to_string(v) + " is not committed yet and is restorable from memory no more (" +
                  missing + ")";
        errors_.Record("job " + s.job + " rank " + std::to_string(s.rank) + ": " + why_not +
                       (requested == 0 ? "; trying an older version" : ""));
        continue;
      }
      Chosen out;
      out.version = v;
      out.latest = latest;
      out.hold = std::move(hold);
      out.world_size = marker->world_size;
      out.registrations = std::move(marker->registrations);
      return out;
    }
  }
  if (!held.ok()) {
    if (requested != 0 && !why_not.empty()) return FailedPrecondition(why_not);
    return held.status();
  }
  auto world = VersionWorldSize(s.job, held->version);
  if (!world.ok()) return world.status();
  Chosen out;
  out.version = held->version;
  out.latest = held->latest;
  out.hold = std::move(held->hold);
  out.world_size = world.value();
  return out;
}

Result<Restored> Restorer::RestoreUncounted(Session& s, std::uint64_t requested,
                                            const CancelCheck& cancelled) {
  for (const auto& [v, shard] : s.shards) {
    if (shard->level() < Level::kCaptured && !shard->failed()) {
      return FailedPrecondition("version " + std::to_string(v) +
                                " is still being captured from this trainer's memory; "
                                "wait for it before restoring");
    }
  }
  auto phase = std::chrono::steady_clock::now();
  if (restart_waits_newest_) {
    if (Status st = shards_.WaitRankNewestSettled(s.job, s.rank, cancelled); !st.ok()) return st;
  }
  const double wait_ms = MsSince(phase);
  phase = std::chrono::steady_clock::now();
  // A rollback is done by the daemon of the first rank that restores: it sets the newer
  // versions aside on the shared directory, so the choice below (which reads the newest
  // committed version from storage) finds no newer one on the other daemons of the job. Each
  // of them still holds its own state of the versions set aside (commits it finished, markers,
  // awaited versions, memory images), which the new timeline's versions of the same numbers
  // must not meet: a version it saw committed above the one restored says the job rolled
  // back. Read before the choice, so that a version of the timeline left that commits
  // meanwhile is chosen (or, asked for by number, rolled back from) as it would be anyway.
  const std::uint64_t seen_committed = commits_.NewestFinished(s.job);
  auto chosen = Choose(s, requested, /*uncommitted_ok=*/true);
  if (!chosen.ok()) return chosen.status();
  // The fast path serves a registration that is this rank's shard, item for item.
  bool elastic = chosen->world_size != s.world_size;
  ShardSource fetched;  // a peer's replica MatchesOwnShard fetched, if any
  ElasticRequest req = ElasticRequestOf(s, chosen->version, chosen->world_size);
  if (!elastic && std::any_of(req.targets.begin(), req.targets.end(),
                              [](const ElasticTarget& t) { return t.layout.has_value(); })) {
    auto same = elastic_.MatchesOwnShard(req, &fetched);
    if (!same.ok()) return same.status().With("restore version " + std::to_string(chosen->version));
    elastic = !same.value();
    if (elastic && !chosen->registrations.empty()) {
      // Resharding reads the version's index.json, which is written at commit. Falling back
      // to a committed version here, on this rank alone, would split the job's ranks between
      // two versions: the trainer is told, and chooses for all of them.
      return FailedPrecondition(
          "version " + std::to_string(chosen->version) + " of job '" + s.job +
          "' is not committed yet, and this rank's registration has other layouts than its shard of it "
          "(restoring into other layouts reads the index.json a commit writes): restore the newest committed "
          "version (" + std::to_string(chosen->latest) + ") by number on every rank, or register this rank's "
          "items as they were");
    }
  }
  const std::uint64_t v = chosen->version;
  const bool uncommitted = !chosen->registrations.empty();
  const std::string* registration = uncommitted ? &chosen->registrations.at(s.rank) : nullptr;
  const double plan_ms = MsSince(phase);
  Result<Restored> restored = elastic ? RestoreElastic(s, req) : RestoreOwnShard(s, v, registration, fetched.image ? &fetched : nullptr);
  if (!restored.ok()) return restored.status();
  if (uncommitted) {
    restored->uncommitted = true;
    ++counters_.uncommitted;
    spdlog::info("job {} rank {}: restored version {}, not committed yet (newest committed: {}), from memory", s.job,
                 s.rank, v, chosen->latest);
    // The versions above it belong to the timeline left (nothing committed is above it).
    tiers_.memory().DropNewerThan(s.job, s.rank, v);
    commits_.RolledBack(s.job, v);
    // v itself never commits now (the ranks register again): it is not awaited, and this
    // rank's shard of it, if this session wrote it, has no failure to report later.
    commits_.Forget(s.job, v);
  } else if (v < chosen->latest || v < seen_committed) {
    if (Status st = RollBack(s, v); !st.ok()) return st;
  }
  // This rank's own versions above v belong to the timeline it left: their failure (set
  // aside) is not news to report on its next snapshot.
  for (auto it = uncommitted ? s.shards.lower_bound(v) : s.shards.upper_bound(v); it != s.shards.end();) {
    it->second->ClaimErrorReport();
    it = s.shards.erase(it);
  }
  // What this rank published before belongs to the timeline it just left.
  phase = std::chrono::steady_clock::now();
  if (Status st = registrar_.NewRegistration(s); !st.ok()) {
    return st.With("after restoring version " + std::to_string(v));
  }
  restored->wait_ms = wait_ms;
  restored->plan_ms = plan_ms;
  restored->registration_ms = MsSince(phase);
  s.last_version = v;
  if (PeerShards* peers = tiers_.peers()) {
    // The timeline above v is left on every daemon too: peers drop this rank's
    // images above v (a replica of an old version v+1 must never be read for the new v+1),
    // and no version above v is taken as restorable. After the new registration, so that a
    // claim deciding one meanwhile sees that this rank's registration changed.
    peers->DropNewer(s.job, s.rank, v);
    tiers_.persistent().DropRestorableNewerThan(s.job, v);
  }
  return restored;
}

}  // namespace ckpt
