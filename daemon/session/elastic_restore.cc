#include "daemon/session/elastic_restore.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <system_error>
#include <thread>

#include "common/names.h"
#include "common/run_parallel.h"
#include "daemon/metrics/daemon_metrics.h"
#include "format/checksum.h"
#include "format/dtype.h"
#include "format/paths.h"
#include "format/version_index.h"

namespace ckpt {

namespace {

// A read task covers at most this many blocks: pieces of a large chunk are read, verified
// and copied on several threads.
constexpr std::uint64_t kTaskBlocks = 16;
// A task reads at most this much at once, whatever the shard claims an item's or a block's
// size to be: a reader thread's buffer never grows past it. Blocks larger than this (no
// writer of ours makes them) are not used: such an item is verified whole, streamed.
constexpr std::uint64_t kReadWindow = 16ull << 20;
// Host regions are written in pieces of this size, several at once.
constexpr std::uint64_t kWritePiece = 8ull << 20;

std::string ShapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status Noted(const Status& s, const std::string& note) {
  return Status(s.code(), s.message() + " (" + note + ")");
}

// Every failure here is a read of a copy (the regions are written after all reads), so an
// IO_ERROR is the copy's.
bool WorthNextCopy(const Status& st, Tier tier) { return ckpt::WorthNextCopy(st, tier, /*io_error_is_copy=*/true); }

// One rank's shard of the version, read from its fastest good copy.
struct LoadedShard {
  std::uint32_t rank = 0;
  bool loaded = false;  // the plan needs it (all of them without an index)
  bool listed = false;  // `sources` is filled (only for the shards the plan needs)
  std::vector<ShardSource> sources;
  std::size_t at = 0;  // the copy in use
  ShardInfo info;
  UniqueFd fd;  // file copies
  std::map<std::string, const ShardItem*> tensors, blobs;

  const ShardSource& src() const { return sources[at]; }
  std::string Where() const {
    if (src().tier == Tier::kPeer) return "the replica of rank " + std::to_string(rank) + " from peer " + src().peer;
    return src().image ? "the memory tier's copy of rank " + std::to_string(rank)
                       : std::string(TierName(src().tier)) + " shard " + src().path;
  }
};

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
  s.info = std::move(info).value();
  s.tensors.clear();
  s.blobs.clear();
  for (const ShardItem& it : s.info.items)
    (it.kind == ItemKind::kTensor ? s.tensors : s.blobs)[it.name] = &it;
  return Status::Ok();
}

// What one piece of the plan copies: `sub` of the stored item (holding `chunk`) into the
// staging buffer of a target (holding `dst`), or a blob whole.
struct Piece {
  std::size_t shard = 0;
  const ShardItem* item = nullptr;
  std::size_t target = SIZE_MAX;  // SIZE_MAX: a blob
  std::size_t blob = 0;           // index into the result's blobs
  Box chunk, sub, dst;
  std::size_t elem = 1;
  const BlockSums* blocks = nullptr;  // null: verified by the item checksum
  std::string global;                 // for messages: the global tensor and box
};

struct Task {
  std::size_t piece = 0;
  std::uint64_t lo = 0, hi = 0;  // bytes of the item
};

}  // namespace

class ElasticRun {
 public:
  ElasticRun(Storage& storage, TierSet& tiers, ErrorLog& errors, const ElasticRequest& req, unsigned readers,
             const RestoreLimits& limits)
      : storage_(storage),
        tiers_(tiers),
        errors_(errors),
        req_(req),
        readers_(std::max(1u, readers)),
        limits_(limits) {}

  // Loads the header of rank r's shard from its fastest good copy.
  Status Load(LoadedShard& s) {
    List(s);
    while (true) {
      Status st = LoadCopy(storage_, tiers_, req_, limits_, s);
      if (st.ok()) return st;
      if (!WorthNextCopy(st, s.src().tier)) return st;
      BadCopy(s, st);
    }
  }

  // Fills the copies of `s`, fastest first. Done only for a shard the plan reads: with peer
  // replication, listing asks every peer whether it holds one.
  void List(LoadedShard& s) {
    if (s.listed) return;
    s.sources = tiers_.Sources(req_.job, req_.version, s.rank);
    s.listed = true;
  }

  // The fastest tier of rank r's shard that is known without asking a peer: memory or local
  // where this daemon holds it, else the persistent tier (a peer's replica is slower than
  // this daemon's own copies, and only worth asking for once the shard is needed).
  Tier LocalTierOf(std::uint32_t r) {
    return tiers_.Sources(req_.job, req_.version, r, /*ask_peers=*/false).front().tier;
  }

  // A copy on a faster tier failed verification: report, drop, go on with the next.
  void BadCopy(LoadedShard& s, const Status& why) {
    metrics::Metrics().Error(metrics::ErrorKind::kRestoreVerify);
    errors_.Record("job " + req_.job + " version " + std::to_string(req_.version) + " rank " +
                   std::to_string(s.rank) + ": the " + TierName(s.src().tier) +
                   " tier's copy " +
                   (why.code() == StatusCode::kDataLoss ? "failed verification" : "could not be read") +
                   " in a restore by rank " + std::to_string(req_.rank) +
                   " of " + std::to_string(req_.world_size) + " (" + why.message() +
                   "); dropped, reading the next tier");
    tiers_.DropCopy(s.src());
    if (s.src().tier == Tier::kPeer) s.sources[s.at].image.reset();  // fetched: outside the budget
    s.fd.reset();
    ++s.at;
  }

  // Loads the shards the plan needs: those the version's index.json names for the
  // registration's boxes, replicated items (one rank, on the fastest tier), rank-private
  // items and blobs; every shard where the version has no readable index. The index only
  // chooses which headers to read: what is restored comes from the (checksummed) headers.
  // The table has an entry only for the ranks needed: a version's world size is a claim of
  // its COMMITTED marker.
  Status LoadAll() {
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

  std::vector<bool> NeededRanks() {
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

  Status Plan(ElasticRestored& out);
  // Runs every piece; a DATA_LOSS of a copy on a faster tier is left in `bad` (per shard).
  Status Read(ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
              std::map<std::size_t, Status>& bad);

  // Rank r's shard; only for a rank the plan reads (loaded).
  LoadedShard& shard(std::size_t r) { return *shards_[r]; }
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  Status PlanTarget(std::size_t i);
  // Reads, verifies and copies one task; `data` is a buffer for a file read.
  Status RunTask(const Task& t, ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                 std::vector<char>& data, std::uint64_t& read);

  Storage& storage_;
  TierSet& tiers_;
  ErrorLog& errors_;
  const ElasticRequest& req_;
  const unsigned readers_;
  const RestoreLimits limits_;
  std::vector<std::unique_ptr<LoadedShard>> shards_;  // null: a rank the plan does not read
  std::vector<Piece> pieces_;
};

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

Status ElasticRun::RunTask(const Task& t, ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                           std::vector<char>& buf, std::uint64_t& read) {
  const Piece& p = pieces_[t.piece];
  const LoadedShard& s = *shards_[p.shard];
  const ShardItem& item = *p.item;
  const std::string what = p.global + ", item " + QuoteName(item.name) + " of " + s.Where() + " (rank " +
                           std::to_string(s.rank) + ")";
  // Windows of whole blocks (p.blocks: no larger than a window), or of any size when the
  // item is verified whole (a multiple of every element size).
  const std::uint64_t window =
      p.blocks == nullptr ? kReadWindow : kReadWindow / p.blocks->block_bytes * p.blocks->block_bytes;
  Checksum whole;  // p.blocks == nullptr: the task is the whole item
  for (std::uint64_t lo = t.lo; lo < t.hi;) {
    const std::uint64_t n = std::min(window, t.hi - lo);
    const std::uint64_t at = s.info.data_start + item.offset + lo;
    const char* data = nullptr;
    if (s.src().image) {
      data = s.src().image->data() + at;
    } else {
      buf.resize(static_cast<std::size_t>(n));
      std::uint64_t got = 0;
      while (got < n) {
        auto r = storage_.ReadAt(s.fd.get(), buf.data() + got, n - got, at + got, s.src().path);
        if (!r.ok()) return r.status();
        if (r.value() == 0) return DataLoss(s.Where() + " ended early (truncated shard)");
        got += r.value();
      }
      read += n;
      data = buf.data();
    }
    if (p.blocks == nullptr) {
      whole.Update(data, n);
    } else if (Status st = VerifyBlocks(*p.blocks, item.length, lo, data, n, what); !st.ok()) {
      return st;
    }
    // Into daemon memory only (a blob, a staging buffer): what reaches a region is written
    // once every piece is verified.
    if (p.target == SIZE_MAX) {
      std::memcpy(out.blobs[p.blob].data.data() + lo, data, n);
    } else if (staging[p.target]) {
      // A target with no staging buffer is written straight from the memory images later.
      CopySubBox(p.sub, p.chunk, data, lo, p.dst, staging[p.target].get(), p.elem, lo, lo + n);
    }
    lo += n;
  }
  if (p.blocks == nullptr && whole.Digest() != item.checksum) {
    return DataLoss(p.global + ": checksum mismatch in item " + QuoteName(item.name) + " of " + s.Where() +
                    " (rank " + std::to_string(s.rank) + ", stored " + ChecksumHex(item.checksum) +
                    ", read " + ChecksumHex(whole.Digest()) + ")");
  }
  return Status::Ok();
}

Status ElasticRun::Read(ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                        std::map<std::size_t, Status>& bad) {
  std::vector<Task> tasks;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    if (p.item->length == 0) continue;
    if (p.blocks == nullptr) {
      tasks.push_back({k, 0, p.item->length});
      continue;
    }
    const std::uint64_t bb = p.blocks->block_bytes;
    for (const auto& [b, e] : TouchedBlocks(TouchedRanges(p.chunk, p.sub, p.elem), bb, p.item->length)) {
      for (std::uint64_t x = b; x < e; x += kTaskBlocks) {
        tasks.push_back({k, x * bb, std::min(std::min(e, x + kTaskBlocks) * bb, p.item->length)});
      }
    }
  }
  // Zero-length items verify against the checksum of nothing.
  for (const Piece& p : pieces_) {
    if (p.item->length == 0 && p.item->checksum != Checksum::Of(nullptr, 0)) {
      return DataLoss(p.global + ": checksum mismatch in empty item " + QuoteName(p.item->name) + " of " +
                      shards_[p.shard]->Where());
    }
  }
  std::vector<Status> status(tasks.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> read_total{0};
  RunParallel(std::min<unsigned>(readers_, static_cast<unsigned>(std::max<std::size_t>(1, tasks.size()))),
              [&] {
                std::vector<char> buf;
                std::uint64_t read = 0;
                while (!stop.load()) {
                  const std::size_t k = next.fetch_add(1);
                  if (k >= tasks.size()) break;
                  status[k] = RunTask(tasks[k], out, staging, buf, read);
                  if (!status[k].ok() &&
                      !WorthNextCopy(status[k], shards_[pieces_[tasks[k].piece].shard]->src().tier))
                    stop.store(true);
                }
                read_total += read;
              });
  out.bytes_read += read_total.load();
  // A bad copy on a faster tier: the caller drops it and plans again; anything else ends here.
  Status fatal;
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    if (status[k].ok()) continue;
    const std::size_t shard = pieces_[tasks[k].piece].shard;
    if (!WorthNextCopy(status[k], shards_[shard]->src().tier)) {
      if (fatal.ok()) fatal = status[k];
    } else if (bad.count(shard) == 0) {
      bad[shard] = status[k];
    }
  }
  return fatal;
}

Result<ElasticRestored> ElasticRestore::Restore(const ElasticRequest& req) {
  ElasticRun run(*storage_, tiers_, errors_, req, readers_, limits_);
  if (Status st = run.LoadAll(); !st.ok()) return Noted(st, "nothing was written to the registered regions");
  // A target is staged (its verified pieces copied into a buffer of its size) when a piece
  // comes from a file, which could change between verification and copy, or when its region
  // is device memory (copied through the lanes from one buffer). A host target whose pieces
  // are all in memory images, which do not change, is written straight from them.
  std::vector<std::unique_ptr<char[]>> staging(req.targets.size());
  ElasticRestored out;
  while (true) {
    if (Status st = run.Plan(out); !st.ok())
      return Noted(st, "nothing was written to the registered regions");
    std::vector<bool> staged(req.targets.size(), false);
    for (std::size_t i = 0; i < req.targets.size(); ++i)
      staged[i] = req.targets[i].target.region->device() >= 0;
    for (const Piece& p : run.pieces()) {
      if (p.target != SIZE_MAX && !run.shard(p.shard).src().image) staged[p.target] = true;
    }
    for (std::size_t i = 0; i < req.targets.size(); ++i) {
      if (staged[i] && !staging[i]) {
        staging[i].reset(new char[std::max<std::uint64_t>(1, req.targets[i].target.item.length)]);
      }
      if (!staged[i]) staging[i].reset();
    }
    std::map<std::size_t, Status> bad;  // by rank
    if (Status st = run.Read(out, staging, bad); !st.ok()) {
      return Noted(st, "nothing was written to the registered regions");
    }
    const bool retry = !bad.empty();
    for (const auto& [r, why] : bad) {
      run.BadCopy(run.shard(r), why);
      if (Status st = run.Load(run.shard(r)); !st.ok()) {
        return Noted(st, "nothing was written to the registered regions");
      }
    }
    if (!retry) break;
  }
  for (const Piece& p : run.pieces()) {
    const Tier tier = run.shard(p.shard).src().tier;
    out.slowest = SlowerTier(out.slowest, tier);
    if (p.target != SIZE_MAX) {
      const std::uint64_t bytes = p.sub.elements() * p.elem;
      out.tier_bytes[static_cast<int>(tier)] += bytes;
      out.tensor_bytes += bytes;
    }
  }

  // Everything is verified: write the staging buffers, or the pieces straight from the
  // memory images, to the regions.
  struct Write {
    std::size_t target;
    std::uint64_t at, len;  // in the item
    const char* src;
  };
  std::vector<Write> host;
  std::map<int, std::vector<Write>> device;
  auto add = [&](std::size_t i, std::uint64_t at, std::uint64_t len, const char* src) {
    for (std::uint64_t done = 0; done < len; done += kWritePiece) {
      Write w{i, at + done, std::min(kWritePiece, len - done), src + done};
      const int dev = req.targets[i].target.region->device();
      (dev < 0 ? host : device[dev]).push_back(w);
    }
  };
  for (std::size_t i = 0; i < req.targets.size(); ++i) {
    if (staging[i]) add(i, 0, req.targets[i].target.item.length, staging[i].get());
  }
  for (const Piece& p : run.pieces()) {
    if (p.target == SIZE_MAX || staging[p.target]) continue;
    const LoadedShard& s = run.shard(p.shard);
    const char* item = s.src().image->data() + s.info.data_start + p.item->offset;
    for (const BoxRun& r : SubBoxRuns(p.sub, p.chunk, p.dst, p.elem))
      add(p.target, r.dst, r.bytes, item + r.src);
  }
  const std::string partly = "the registered regions are partly written: do not train on them";
  for (const auto& [dev, writes] : device) {
    if (backend_ == nullptr) {
      return FailedPrecondition("region " + req.targets[writes.front().target].target.region->name() +
                                " is device memory, and this daemon has no device backend");
    }
    auto lanes = backend_->MakeLanes(dev, std::max(1u, lanes_));
    if (!lanes.ok()) return lanes.status().With("create copy streams for a restore");
    std::vector<std::pair<CopyLane*, std::uint64_t>> tickets;
    Status copied;
    for (std::size_t k = 0; k < writes.size() && copied.ok(); ++k) {
      const Write& w = writes[k];
      const RestoreTarget& t = req.targets[w.target].target;
      CopyLane& lane = *lanes.value()[k % lanes.value().size()];
      copied = lane.CopyIn(*t.region, t.region_offset + w.at, w.src, w.len);
      if (!copied.ok()) copied = copied.With("restore item " + QuoteName(t.item.name));
      auto ticket = lane.EndChunk();
      if (ticket.ok()) {
        tickets.emplace_back(&lane, ticket.value());
      } else if (copied.ok()) {
        copied = ticket.status();
      }
    }
    for (auto& [lane, ticket] : tickets) {
      Status s = lane->WaitChunk(ticket, [] { return false; });
      if (copied.ok() && !s.ok()) copied = s;
    }
    if (!copied.ok()) return Noted(copied, partly);
  }
  for (const auto& et : req.targets) {
    if (et.target.region->device() < 0)
      et.target.region->Preallocate(et.target.region_offset, et.target.item.length);
  }
  std::vector<Status> written(host.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  RunParallel(std::min<unsigned>(std::max(1u, readers_),
                                 static_cast<unsigned>(std::max<std::size_t>(1, host.size()))),
              [&] {
                while (!failed.load()) {
                  const std::size_t k = next.fetch_add(1);
                  if (k >= host.size()) break;
                  const Write& w = host[k];
                  const RestoreTarget& t = req.targets[w.target].target;
                  Status s = t.region->WriteAt(t.region_offset + w.at, w.src, w.len);
                  if (!s.ok()) {
                    written[k] = s.With("restore item " + QuoteName(t.item.name));
                    failed.store(true);
                  }
                }
              });
  for (const Status& s : written) {
    if (!s.ok()) return Noted(s, partly);
  }
  return out;
}

Result<bool> ElasticRestore::MatchesOwnShard(const ElasticRequest& req, ShardSource* fetched) {
  ElasticRun run(*storage_, tiers_, errors_, req, readers_, limits_);
  LoadedShard s;
  s.rank = req.rank;
  if (Status st = run.Load(s); !st.ok()) return st;
  if (fetched != nullptr && s.src().tier == Tier::kPeer && s.src().image) *fetched = s.src();
  if (s.tensors.size() != req.targets.size()) return false;
  for (const ElasticTarget& t : req.targets) {
    auto it = s.tensors.find(t.target.item.name);
    if (it == s.tensors.end() || it->second->shape != t.target.item.shape ||
        it->second->dtype != t.target.item.dtype) {
      return false;
    }
    // Both resolved: equal when the item is the same box of the same global tensor.
    if (it->second->layout != t.layout) return false;
  }
  return true;
}

}  // namespace ckpt
