// ElasticRestore's plan (elastic_restore.h, steps 1 and 2): the headers of the shards the
// registration needs, each from its fastest good copy, and the pieces to copy from them.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/names.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/session/elastic_run.h"
#include "format/dtype.h"
#include "format/paths.h"
#include "format/version_index.h"

namespace ckpt::elastic_internal {
namespace {

// Reads the header of `s`'s current copy and checks it is (job, version, rank) of W. A
// replica in a peer's memory (peer replication) is fetched whole first.
Status LoadCopy(Storage& storage, TierSet& tiers, const ElasticRequest& req, const RestoreLimits& limits,
                LoadedShard& s) {
  if (s.src().tier == Tier::kPeer && !s.src().image) {
    auto image = tiers.FetchFromPeer(s.src(), req.job, req.version, s.rank);
    // A peer that cannot give it is worth the next source, like a missing copy (NOT_FOUND:
    // reported as "could not be read", not as a failed verification).
    if (!image.ok()) return NotFound(s.Where() + ": " + image.status().message());
    s.sources[s.at].image = std::move(image).value();
  }
  const ShardSource& src = s.src();
  const std::string where = s.Where();
  std::string json;
  std::uint64_t file_bytes = 0;
  if (src.image) {
    const MemoryImage& image = *src.image;
    file_bytes = image.file_bytes;
    if (file_bytes < 8) return DataLoss(where + " is too short");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(image.data()[i]);
    if (n > file_bytes - 8) return DataLoss(where + ": header size past the end");
    json.assign(image.data() + 8, n);
  } else {
    auto fd = storage.OpenForRead(src.path, /*direct=*/false);
    if (!fd.ok()) return fd.status();
    s.fd = std::move(fd).value();
    struct stat st {};
    if (::fstat(s.fd.get(), &st) != 0) return IoError("stat " + src.path, errno);
    file_bytes = static_cast<std::uint64_t>(st.st_size);
    char prefix[8];
    auto got = storage.ReadAt(s.fd.get(), prefix, 8, 0, src.path);
    if (!got.ok()) return got.status();
    if (got.value() < 8) return DataLoss(where + " is too short");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
    if (n > file_bytes - 8 || n > kMaxHeaderBytes) return DataLoss(where + ": header size past the end");
    json.resize(n);
    auto read = storage.ReadAt(s.fd.get(), json.data(), n, 8, src.path);
    if (!read.ok()) return read.status();
    if (read.value() < n) return DataLoss(where + " ended early (truncated shard)");
  }
  auto info = ParseShardHeader(json, file_bytes);
  if (!info.ok()) return info.status().With(where);
  const ShardMeta& m = info->meta;
  if (m.job != req.job || m.version != req.version || m.rank != s.rank ||
      m.world_size != req.version_world_size) {
    return DataLoss(where + " holds version " + std::to_string(m.version) + " of rank " +
                    std::to_string(m.rank) + " of " + std::to_string(m.world_size) + " (job '" + m.job +
                    "'), not version " + std::to_string(req.version) + " of rank " + std::to_string(s.rank) +
                    " of " + std::to_string(req.version_world_size) +
                    " (was written by another rank or copied into place)");
  }
  if (Status st = CheckBlobBytes(where, info.value(), limits); !st.ok()) return st;
  s.files.reset();
  if (info->base) {
    if (src.image) return DataLoss(where + " is a differential shard (only files of the persistent tier are)");
    auto files = ShardFiles::Adopt(std::move(s.fd), info.value(), src.path);
    if (!files.ok()) return files.status();
    s.files = std::move(files).value();
  }
  s.info = std::move(info).value();
  s.tensors.clear();
  s.blobs.clear();
  for (const ShardItem& it : s.info.items)
    (it.kind == ItemKind::kTensor ? s.tensors : s.blobs)[it.name] = &it;
  return Status::Ok();
}

}  // namespace

Status ElasticRun::Load(LoadedShard& s) {
  List(s);
  while (true) {
    Status st = LoadCopy(storage_, tiers_, req_, limits_, s);
    if (st.ok()) return st;
    if (!WorthNextCopy(st, s.src().tier)) return st;
    BadCopy(s, st);
  }
}

void ElasticRun::List(LoadedShard& s) {
  if (s.listed) return;
  s.sources = tiers_.Sources(req_.job, req_.version, s.rank);
  s.listed = true;
}

Tier ElasticRun::LocalTierOf(std::uint32_t r) {
  return tiers_.Sources(req_.job, req_.version, r, /*ask_peers=*/false).front().tier;
}

void ElasticRun::BadCopy(LoadedShard& s, const Status& why) {
  metrics::Metrics().Error(metrics::ErrorKind::kRestoreVerify);
  errors_.Record("job " + req_.job + " version " + std::to_string(req_.version) + " rank " +
                 std::to_string(s.rank) + ": the " + TierName(s.src().tier) + " tier's copy " +
                 (why.code() == StatusCode::kDataLoss ? "failed verification" : "could not be read") +
                 " in a restore by rank " + std::to_string(req_.rank) + " of " +
                 std::to_string(req_.world_size) + " (" + why.message() +
                 "); dropped, reading the next tier");
  tiers_.DropCopy(s.src());
  if (s.src().tier == Tier::kPeer) s.sources[s.at].image.reset();  // fetched: outside the budget
  s.fd.reset();
  s.files.reset();
  ++s.at;
}

Status ElasticRun::LoadAll() {
  shards_.resize(req_.version_world_size);
  std::vector<bool> need = NeededRanks();
  for (std::uint32_t r = 0; r < req_.version_world_size; ++r) {
    if (!need[r]) continue;
    shards_[r] = std::make_unique<LoadedShard>();
    shards_[r]->rank = r;
    if (Status st = Load(*shards_[r]); !st.ok()) return st;
    shards_[r]->loaded = true;
  }
  return Status::Ok();
}

std::vector<bool> ElasticRun::NeededRanks() {
  const std::uint32_t w = req_.version_world_size;
  std::vector<bool> all(w, true), need(w, false);
  const std::string path = JoinPath(tiers_.persistent().VersionDir(req_.job, req_.version), kIndexFileName);
  auto text = storage_.ReadSmallFile(path);
  if (!text.ok()) return all;  // a version written before the index
  auto index = VersionIndex::Parse(text.value());
  if (!index.ok() || index->world_size != w || index->version != req_.version) {
    errors_.Record("job " + req_.job + " version " + std::to_string(req_.version) + ": " + path +
                   " is not this version's index (" +
                   (index.ok() ? std::string("another version or world size") : index.status().message()) +
                   "); reading every shard's header instead");
    return all;
  }
  if (req_.rank < w) need[req_.rank] = true;  // rank-private items
  for (const IndexBlob& b : index->blobs) {
    if (!b.for_rank || *b.for_rank == req_.rank) need[b.rank] = true;
  }
  for (const ElasticTarget& t : req_.targets) {
    if (!t.layout) continue;
    auto it = index->tensors.find(t.layout->global_name);
    if (it == index->tensors.end()) continue;  // the plan says so
    if (t.layout->replicated) {
      // One holder: this rank (read anyway, for its rank-private items), else the one on
      // the fastest of this daemon's tiers, else the first.
      const IndexChunk* best = nullptr;
      Tier best_tier = Tier::kPersistent;
      for (const IndexChunk& c : it->second.chunks) {
        if (c.rank >= w) continue;
        if (c.rank == req_.rank) {
          best = &c;
          break;
        }
        const Tier tier = LocalTierOf(c.rank);
        if (best == nullptr || FasterTier(tier, best_tier)) best = &c, best_tier = tier;
      }
      if (best != nullptr) need[best->rank] = true;
      continue;
    }
    const Box box{t.layout->offsets, t.target.item.shape};
    for (const IndexChunk& c : it->second.chunks) {
      if (c.offsets.size() == box.rank() && Intersect(box, Box{c.offsets, c.shape})) need[c.rank] = true;
    }
  }
  return need;
}

Status ElasticRun::PlanTarget(std::size_t i) {
  const ElasticTarget& et = req_.targets[i];
  const ShardItem& want = et.target.item;
  const std::size_t elem = DTypeSize(want.dtype);
  const std::string name = QuoteName(want.name);
  auto whole = [&](std::size_t shard, const ShardItem* item, std::string global) {
    Piece p;
    p.shard = shard;
    p.item = item;
    p.target = i;
    p.chunk = p.sub = p.dst = Box{{0}, {static_cast<std::int64_t>(item->length)}};
    p.elem = 1;
    p.global = std::move(global);
    pieces_.push_back(std::move(p));
  };
  auto same_type = [&](const ShardItem& stored, std::uint32_t rank) -> Status {
    if (stored.dtype != want.dtype) {
      return FailedPrecondition("item " + name + " is registered as " + std::string(DTypeName(want.dtype)) +
                                " but rank " + std::to_string(rank) + " of version " +
                                std::to_string(req_.version) + " stored it as " +
                                std::string(DTypeName(stored.dtype)));
    }
    return Status::Ok();
  };

  if (!et.layout) {
    if (req_.version_world_size != req_.world_size) {
      return FailedPrecondition(
          "item " + name + " is rank-private (registered without a layout), and version " +
          std::to_string(req_.version) + " was written by " + std::to_string(req_.version_world_size) +
          " ranks, not " + std::to_string(req_.world_size) +
          ": a rank-private item restores only to its own rank at the same world size; register it with a "
          "layout (a box of a global tensor, or replicated) when saving, or restore with " +
          std::to_string(req_.version_world_size) + " ranks");
    }
    const LoadedShard& own = *shards_[req_.rank];
    auto it = own.tensors.find(want.name);
    if (it == own.tensors.end()) {
      return FailedPrecondition("rank " + std::to_string(req_.rank) + "'s shard of version " +
                                std::to_string(req_.version) + " has no tensor item " + name +
                                ", which this trainer registered without a layout");
    }
    if (Status st = same_type(*it->second, req_.rank); !st.ok()) return st;
    if (it->second->shape != want.shape) {
      return FailedPrecondition("item " + name + " has shape " + ShapeText(it->second->shape) +
                                " in the checkpoint but is registered with shape " + ShapeText(want.shape));
    }
    whole(req_.rank, it->second, "rank-private item " + name);
    return Status::Ok();
  }

  const GlobalLayout& layout = *et.layout;
  const std::string gname = QuoteName(layout.global_name);
  // Every chunk of the global tensor, in rank order.
  struct Chunk {
    std::size_t shard;
    const ShardItem* item;
    const GlobalLayout* layout;
  };
  std::vector<Chunk> chunks;
  for (std::size_t r = 0; r < shards_.size(); ++r) {
    if (!shards_[r] || !shards_[r]->loaded) continue;
    for (const ShardItem& it : shards_[r]->info.items) {
      if (it.kind == ItemKind::kTensor && it.layout && it.layout->global_name == layout.global_name) {
        chunks.push_back({r, &it, &*it.layout});
      }
    }
  }
  if (chunks.empty()) {
    return FailedPrecondition("version " + std::to_string(req_.version) + " has no global tensor " + gname +
                              " (item " + name + " asks for it" +
                              (layout.replicated ? std::string(" replicated")
                                                 : " at box " + BoxText(Box{layout.offsets, want.shape})) +
                              ")");
  }
  if (layout.replicated) {
    // One copy: the first on the fastest tier.
    const Chunk* best = nullptr;
    for (const Chunk& c : chunks) {
      if (!c.layout->replicated) {
        return FailedPrecondition("item " + name + " is registered as replicated, but global tensor " +
                                  gname + " is stored as chunks of shape " +
                                  ShapeText(c.layout->global_shape));
      }
      if (best == nullptr || FasterTier(shards_[c.shard]->src().tier, shards_[best->shard]->src().tier))
        best = &c;
    }
    if (Status st = same_type(*best->item, shards_[best->shard]->rank); !st.ok()) return st;
    if (best->item->shape != want.shape) {
      return FailedPrecondition("replicated item " + name + " has shape " + ShapeText(best->item->shape) +
                                " in the checkpoint but is registered with shape " + ShapeText(want.shape));
    }
    whole(best->shard, best->item, "replicated global tensor " + gname);
    return Status::Ok();
  }

  const Box box{layout.offsets, want.shape};
  const std::size_t first = pieces_.size();
  std::uint64_t covered = 0;
  for (const Chunk& c : chunks) {
    const std::uint32_t rank = shards_[c.shard]->rank;
    if (c.layout->replicated) {
      return FailedPrecondition("item " + name + " asks for box " + BoxText(box) + " of global tensor " +
                                gname + ", which rank " + std::to_string(rank) + " stored as replicated");
    }
    if (Status st = same_type(*c.item, rank); !st.ok()) return st;
    if (c.layout->global_shape != layout.global_shape) {
      return FailedPrecondition("item " + name + " is registered as a box of global tensor " + gname +
                                " of shape " + ShapeText(layout.global_shape) + ", but version " +
                                std::to_string(req_.version) + " stored it with shape " +
                                ShapeText(c.layout->global_shape) + " (rank " + std::to_string(rank) + ")");
    }
    const Box chunk{c.layout->offsets, c.item->shape};
    auto sub = Intersect(box, chunk);
    if (!sub) continue;
    for (std::size_t k = first; k < pieces_.size(); ++k) {
      if (auto both = Intersect(*sub, pieces_[k].sub)) {
        return DataLoss("global tensor " + gname + " of version " + std::to_string(req_.version) +
                        ": the chunks of rank " + std::to_string(shards_[pieces_[k].shard]->rank) +
                        " and rank " + std::to_string(rank) + " overlap at " + BoxText(*both));
      }
    }
    covered += sub->elements();
    Piece p;
    p.shard = c.shard;
    p.item = c.item;
    p.target = i;
    p.chunk = chunk;
    p.sub = std::move(sub).value();
    p.dst = box;
    p.elem = elem;
    // Blocks whose size is not a whole number of elements would cut an element in two; blocks
    // larger than a read window would make a window as large as a shard says.
    const std::uint64_t bb = c.item->blocks.block_bytes;
    if (bb != 0 && bb % elem == 0 && bb <= kReadWindow) p.blocks = &c.item->blocks;
    p.global = "global tensor " + gname + " box " + BoxText(p.sub);
    pieces_.push_back(std::move(p));
  }
  if (covered != box.elements()) {
    return FailedPrecondition("version " + std::to_string(req_.version) + " does not cover box " +
                              BoxText(box) + " of global tensor " + gname + " (item " + name +
                              "): its chunks hold " + std::to_string(covered) + " of its " +
                              std::to_string(box.elements()) + " elements");
  }
  return Status::Ok();
}

Status ElasticRun::Plan(ElasticRestored& out) {
  pieces_.clear();
  out.blobs.clear();
  for (std::size_t i = 0; i < req_.targets.size(); ++i) {
    if (Status st = PlanTarget(i); !st.ok()) return st;
  }
  // Blobs: those meant for every rank, and those meant for this one. Each copy's blobs are
  // within the limit (LoadCopy); all of them together must be too, before any is allocated.
  std::uint64_t blob_bytes = 0;
  for (std::size_t r = 0; r < shards_.size(); ++r) {
    if (!shards_[r] || !shards_[r]->loaded) continue;
    for (const ShardItem& it : shards_[r]->info.items) {
      if (it.kind == ItemKind::kBlob && (!it.for_rank || *it.for_rank == req_.rank)) blob_bytes += it.length;
    }
  }
  if (blob_bytes > limits_.max_blob_bytes) {
    return DataLoss("the blobs of version " + std::to_string(req_.version) + " for rank " +
                    std::to_string(req_.rank) + " total " + std::to_string(blob_bytes) +
                    " bytes over its shards, over --max-blob-mib " +
                    std::to_string(limits_.max_blob_bytes >> 20) + " (what a restore hands back)");
  }
  for (std::size_t r = 0; r < shards_.size(); ++r) {
    if (!shards_[r] || !shards_[r]->loaded) continue;
    const LoadedShard& s = *shards_[r];
    for (const ShardItem& it : s.info.items) {
      if (it.kind != ItemKind::kBlob) continue;
      if (it.for_rank && *it.for_rank != req_.rank) continue;
      Piece p;
      p.shard = r;
      p.item = &it;
      p.blob = out.blobs.size();
      p.chunk = p.sub = p.dst = Box{{0}, {static_cast<std::int64_t>(it.length)}};
      p.global = "blob " + QuoteName(it.name);
      pieces_.push_back(std::move(p));
      out.blobs.push_back({it.name, std::string(it.length, '\0'), s.rank});
    }
  }
  return Status::Ok();
}

}  // namespace ckpt::elastic_internal
