#include "daemon/pipeline/tier_set.h"

#include <algorithm>

#include "format/paths.h"

namespace ckpt {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kMemory:
      return "memory";
    case Tier::kLocal:
      return "local";
    case Tier::kPersistent:
      return "persistent";
    case Tier::kPeer:
      return "peer";
  }
  return "persistent";
}

namespace {
int SpeedRank(Tier tier) {
  switch (tier) {
    case Tier::kMemory:
      return 0;
    case Tier::kLocal:
      return 1;
    case Tier::kPeer:
      return 2;
    case Tier::kPersistent:
      return 3;
  }
  return 3;
}
}  // namespace

bool FasterTier(Tier a, Tier b) { return SpeedRank(a) < SpeedRank(b); }

bool WorthNextCopy(const Status& st, Tier tier, bool io_error_is_copy) {
  if (tier == Tier::kPersistent) return false;
  return st.code() == StatusCode::kDataLoss || st.code() == StatusCode::kNotFound ||
         (io_error_is_copy && st.code() == StatusCode::kIoError);
}

VersionHold::VersionHold(Catalog& catalog, LocalTier* local, std::string job, std::uint64_t version)
    : catalog_(catalog), local_(local), job_(std::move(job)), version_(version) {
  catalog_.Pin(job_, version_);
  if (local_) local_->Pin(job_, version_);
}

VersionHold::~VersionHold() {
  if (local_) local_->Unpin(job_, version_);
  catalog_.Unpin(job_, version_);
}

Result<HeldVersion> TierSet::HoldCommitted(const std::string& job, std::uint64_t requested) {
  HeldVersion held;
  // Another node's daemon may have committed since this one last looked.
  held.latest = catalog_.RefreshLatest(job);
  held.version = requested == 0 ? held.latest : requested;
  if (held.version == 0)
    return NotFound("job '" + job + "' has no committed version under " + catalog_.root());
  // Held before the check, so that retention cannot delete it between the two.
  held.hold = std::make_unique<VersionHold>(catalog_, local_, job, held.version);
  if (!catalog_.IsCommitted(job, held.version)) {
    return NotFound(
        "version " + std::to_string(held.version) + " of job '" + job + "' is not committed" +
        (held.latest ? " (newest committed: " + std::to_string(held.latest) + ")" : std::string()));
  }
  return held;
}

std::vector<ShardSource> TierSet::Sources(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                          bool ask_peers, const std::string* registration) {
  std::vector<ShardSource> out;
  if (auto image = memory_.Find(job, version, rank);
      image && (registration == nullptr || image->meta.session == *registration)) {
    ShardSource src;
    src.tier = Tier::kMemory;
    src.image = std::move(image);
    out.push_back(std::move(src));
  }
  const bool in_memory = !out.empty();
  if (local_ && local_->Has(job, version, rank)) {
    out.push_back(
        ShardSource{Tier::kLocal, nullptr, local_->ShardPath(job, version, rank), local_->direct_io(), ""});
  }
  if (ask_peers && peers_ && !in_memory) {
    for (std::string& peer : peers_->Holding(job, version, rank)) {
      ShardSource src;
      src.tier = Tier::kPeer;
      src.peer = std::move(peer);
      out.push_back(std::move(src));
    }
  }
  out.push_back(ShardSource{Tier::kPersistent, nullptr, catalog_.ShardPath(job, version, rank),
                            persistent_direct_io_, ""});
  return out;
}

Result<std::shared_ptr<MemoryImage>> TierSet::FetchFromPeer(const ShardSource& src, const std::string& job,
                                                           std::uint64_t version, std::uint32_t rank) {
  if (!peers_) return FailedPrecondition("no peer replication on this daemon");
  return peers_->Fetch(src.peer, job, version, rank);
}

void TierSet::DropCopy(const ShardSource& copy) {
  switch (copy.tier) {
    case Tier::kMemory:
      memory_.Drop(copy.image);
      break;
    case Tier::kLocal:
      storage_->Remove(copy.path);
      break;
    case Tier::kPersistent:
    case Tier::kPeer:  // the fetched image is the restore's own; the peer keeps its copy
      break;
  }
}

Result<std::map<std::uint64_t, VersionOnTiers>> TierSet::List(const std::string& job) {
  auto versions = catalog_.List(job);
  if (!versions.ok()) return versions.status();
  std::map<std::uint64_t, VersionOnTiers> out;
  for (const auto& e : versions.value()) {
    auto& v = out[e.version];
    v.committed = e.committed;
    v.restorable = e.restorable && !e.committed;
    if (!e.committed) v.aborted = e.aborted;
    if (e.committed) v.under_replicated = e.under_replicated;
    v.persistent_ranks = e.ranks;
  }
  auto note = [&](std::uint64_t version) -> VersionOnTiers& {
    auto& v = out[version];
    if (!v.committed) v.committed = catalog_.IsCommitted(job, version);
    return v;
  };
  if (local_) {
    for (auto& [version, ranks] : local_->List(job)) note(version).local_ranks = std::move(ranks);
  }
  for (auto& [version, ranks] : memory_.List(job)) note(version).memory_ranks = std::move(ranks);
  for (auto& [version, held] : memory_.ListReplicas(job)) note(version).replicas_held = std::move(held);
  return out;
}

Status TierSet::Load(const std::string& path, bool direct_io, MemoryImage& image) {
  auto fd = storage_->OpenForRead(path, direct_io);
  if (!fd.ok()) return fd.status();
  // O_DIRECT reads whole pages: the image's capacity is the file rounded up to one.
  const std::uint64_t len = direct_io ? image.capacity() : image.file_bytes;
  std::uint64_t done = 0;
  while (done < image.file_bytes) {
    const std::uint64_t n = std::min<std::uint64_t>(len - done, read_piece_bytes_);
    auto got = storage_->ReadAt(fd->get(), image.data() + done, n, done, path);
    if (!got.ok()) return got.status();
    if (got.value() == 0) return DataLoss(path + " ended early (truncated shard)");
    done += got.value();
  }
  return Status::Ok();
}

Result<PrefetchResult> TierSet::Prefetch(const std::string& job, std::uint64_t requested,
                                         std::vector<std::uint32_t> ranks) {
  if (!local_ && !memory_.enabled()) {
    return FailedPrecondition(
        "this daemon has neither a local tier (--local) nor a memory tier "
        "(--memory-mib): nothing to prefetch into");
  }
  auto held = HoldCommitted(job, requested);
  if (!held.ok()) return held.status();
  const std::uint64_t v = held->version;
  if (ranks.empty()) {
    auto listed = storage_->List(catalog_.VersionDir(job, v));
    if (!listed.ok()) return listed.status();
    for (const auto& f : listed.value()) {
      if (auto r = ParseShardFileName(f)) ranks.push_back(*r);
    }
    std::sort(ranks.begin(), ranks.end());
  }
  PrefetchResult out;
  out.version = v;
  out.ranks = static_cast<std::uint32_t>(ranks.size());
  for (std::uint32_t rank : ranks) {
    const std::string context = "prefetch rank " + std::to_string(rank);
    const std::string src = catalog_.ShardPath(job, v, rank);
    auto info = ReadShardHeader(src);
    if (!info.ok()) return info.status().With(context);
    if (info->base) {
      // Differential (daemon/pipeline/differential.h): the faster tiers hold whole shards
      // only, and a restore reads this one and its base from the persistent tier.
      ++out.differential_shards;
      continue;
    }
    std::string read_from = src;
    bool read_direct = persistent_direct_io_;
    if (local_) {
      if (!local_->Has(job, v, rank)) {
        ShardCopier::Source from{src, persistent_direct_io_, nullptr, info->file_bytes};
        ShardCopier::Target to{local_->VersionDir(job, v), ShardFileName(rank), local_->direct_io(), v};
        auto copied = copier_.Copy(from, to);
        if (!copied.ok()) return copied.status().With(context + " to local");
        out.bytes += copied.value();
        ++out.local_shards;
      }
      read_from = local_->ShardPath(job, v, rank);
      read_direct = local_->direct_io();
    }
    if (!memory_.enabled() || memory_.Find(job, v, rank)) continue;
    auto image = memory_.Reserve(info->meta, info->file_bytes);
    if (!image) continue;  // does not fit: restores read the file
    if (Status st = Load(read_from, read_direct, *image); !st.ok()) {
      memory_.Drop(image);
      return st;
    }
    if (!local_) out.bytes += image->file_bytes;
    memory_.Complete(image);
    ++out.memory_shards;
  }
  memory_.OnCommitted(job, v);
  return out;
}

}  // namespace ckpt
