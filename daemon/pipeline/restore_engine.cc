#include "daemon/pipeline/restore_engine.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <system_error>
#include <thread>

#include "common/names.h"
#include "common/run_parallel.h"
#include "format/checksum.h"
#include "format/shard_files.h"

namespace ckpt {

// Where the bytes of a shard come from: its file, its memory-tier image, or, for a
// differential shard, a whole shard laid over two files (`segments`).
struct ShardBytes {
  Storage* storage = nullptr;
  int fd = -1;
  const std::string* path = nullptr;
  const MemoryImage* image = nullptr;
  // A run of the whole shard's bytes, from `at` on, read from `fd` at `from`.
  struct Segment {
    std::uint64_t at = 0, length = 0;
    int fd = -1;
    std::uint64_t from = 0;
    const std::string* path = nullptr;
  };
  std::vector<Segment> segments;  // sorted by `at`, touching
  std::uint64_t file_bytes = 0;   // of the whole shard (segments only)

  // Reads `len` bytes at file offset `off` into `dst`; returns how many there were.
  Result<std::size_t> Read(std::uint64_t off, char* dst, std::size_t len) const {
    if (!segments.empty()) return ReadSegments(off, dst, len);
    if (image == nullptr) return storage->ReadAt(fd, dst, len, off, *path);
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(len, image->file_bytes - off));
    std::memcpy(dst, image->data() + off, n);
    return n;
  }

  Result<std::size_t> ReadSegments(std::uint64_t off, char* dst, std::size_t len) const {
    if (off >= file_bytes) return std::size_t{0};
    len = static_cast<std::size_t>(std::min<std::uint64_t>(len, file_bytes - off));
    auto it = std::upper_bound(segments.begin(), segments.end(), off,
                               [](std::uint64_t o, const Segment& s) { return o < s.at; });
    std::size_t done = 0;
    for (--it; done < len && it != segments.end(); ++it) {
      const std::uint64_t within = off + done - it->at;
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(len - done, it->length - within));
      for (std::size_t got = 0; got < n;) {
        auto r = storage->ReadAt(it->fd, dst + done + got, n - got, it->from + within + got, *it->path);
        if (!r.ok()) return r.status();
        if (r.value() == 0) return DataLoss(*it->path + " ended early (truncated shard)");
        got += r.value();
      }
      done += n;
    }
    return done;
  }
};

// A differential shard (format/shard_files.h) as the whole shard it stands for: its items
// laid out as the differential shard's stored items, then those in the base, each read
// from where it is. *whole gets the header of that whole shard (only its data section is
// read: it starts where the differential shard's does).
ShardBytes WholeShard(Storage* storage, const ShardFiles& files, ShardInfo* whole) {
  ShardBytes src;
  src.storage = storage;
  *whole = files.info();
  whole->base.reset();
  std::uint64_t at = whole->data_start;
  // The header and the stored items: the differential file as it is.
  std::uint64_t stored = 0;
  for (const ShardItem& item : whole->items) stored += item.in_base ? 0 : item.length;
  src.segments.push_back({0, whole->data_start + stored, files.fd(), 0, &files.path()});
  at += stored;
  std::uint64_t offset = stored;
  for (std::size_t i = 0; i < whole->items.size(); ++i) {
    ShardItem& item = whole->items[i];
    if (!item.in_base) continue;
    item.in_base = false;
    item.offset = offset;
    if (item.length > 0) {
      const ShardFiles::Location where = files.Locate(i);
      src.segments.push_back({at, item.length, where.fd, where.offset, where.path});
    }
    at += item.length;
    offset += item.length;
  }
  whole->file_bytes = at;
  src.file_bytes = at;
  return src;
}

namespace {

// Milliseconds since `t` (the restore's breakdown).
double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

Status MatchLayout(const ShardInfo& info, const std::vector<RestoreTarget>& targets) {
  std::map<std::string, const ShardItem*> stored;
  for (const auto& item : info.items) {
    if (item.kind == ItemKind::kTensor) stored[item.name] = &item;
  }
  for (const auto& t : targets) {
    auto it = stored.find(t.item.name);
    if (it == stored.end()) {
      return FailedPrecondition("the checkpoint has no tensor item " + QuoteName(t.item.name) +
                                ", which this trainer registered");
    }
    const ShardItem& s = *it->second;
    if (s.dtype != t.item.dtype) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " is " + std::string(DTypeName(s.dtype)) +
                                " in the checkpoint but registered as " +
                                std::string(DTypeName(t.item.dtype)));
    }
    if (s.shape != t.item.shape) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " has shape " + ShapeText(s.shape) +
                                " in the checkpoint but is registered with shape " + ShapeText(t.item.shape));
    }
    if (s.length != t.item.length) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " has " + std::to_string(s.length) +
                                " bytes in the checkpoint but " + std::to_string(t.item.length) +
                                " registered");
    }
    stored.erase(it);
  }
  if (!stored.empty()) {
    return FailedPrecondition("the checkpoint has tensor item " + QuoteName(stored.begin()->first) +
                              " (and " + std::to_string(stored.size() - 1) +
                              " more) that this trainer did not register");
  }
  return Status::Ok();
}

}  // namespace

Status CheckBlobBytes(const std::string& what, const ShardInfo& info, const RestoreLimits& limits) {
  std::uint64_t blob_bytes = 0;  // cannot wrap: every item lies in the file (kMaxShardDataBytes)
  for (const auto& item : info.items) {
    if (item.kind == ItemKind::kBlob) blob_bytes += item.length;
  }
  if (blob_bytes > limits.max_blob_bytes) {
    return DataLoss(what + ": its blobs total " + std::to_string(blob_bytes) +
                    " bytes, over --max-blob-mib " + std::to_string(limits.max_blob_bytes >> 20) +
                    " (what a restore hands back; not read, nothing allocated for them)");
  }
  return Status::Ok();
}

namespace {

// Takes a shard's data section in order, in pieces of any size: checks each item's
// checksum as its last byte passes and keeps the blobs. It writes nothing to a region.
class ItemVerifier {
 public:
  ItemVerifier(std::string what, const ShardInfo& info, RestoredShard& out)
      : what_(std::move(what)), items_(info.items), blob_(items_.size(), nullptr) {
    for (const auto& item : items_) {
      if (item.kind == ItemKind::kBlob) {
        out.blobs.emplace_back(item.name, std::string());
        out.blobs.back().second.reserve(item.length);
      } else {
        out.tensor_bytes += item.length;
      }
    }
    // Pointers into out.blobs are taken once it no longer grows.
    for (std::size_t i = 0, b = 0; i < items_.size(); ++i) {
      if (items_[i].kind == ItemKind::kBlob) blob_[i] = &out.blobs[b++].second;
    }
  }

  // Items of zero length at the start are complete before any byte.
  Status Begin() { return CloseItems(); }

  Status Consume(const char* src, std::uint64_t want) {
    std::uint64_t used = 0;
    while (used < want) {
      const ShardItem& it = items_[item_];
      std::size_t n = static_cast<std::size_t>(std::min(want - used, it.length - in_item_));
      sum_.Update(src + used, n);
      if (blob_[item_] != nullptr) blob_[item_]->append(src + used, n);
      used += n;
      in_item_ += n;
      if (Status s = CloseItems(); !s.ok()) return s;
    }
    return Status::Ok();
  }

 private:
  Status CloseItems() {
    while (item_ < items_.size() && in_item_ == items_[item_].length) {
      if (sum_.Digest() != items_[item_].checksum) {
        return DataLoss(what_ + ": checksum mismatch in item " + QuoteName(items_[item_].name) + " (stored " +
                        ChecksumHex(items_[item_].checksum) + ", read " + ChecksumHex(sum_.Digest()) + ")");
      }
      sum_ = Checksum();
      ++item_;
      in_item_ = 0;
    }
    return Status::Ok();
  }

  std::string what_;
  const std::vector<ShardItem>& items_;
  std::vector<std::string*> blob_;
  std::size_t item_ = 0;
  std::uint64_t in_item_ = 0;
  Checksum sum_;
};

// How a shard's bytes fall into pool chunks: chunk k holds the file's bytes from
// read_start + k * chunk on, where read_start is the 4 KiB boundary at or before the data
// section (as O_DIRECT needs: a valid shard from another writer may put its data anywhere
// after the header).
struct ChunkGeometry {
  ChunkGeometry(const ShardInfo& info, std::uint64_t chunk_bytes)
      : chunk(chunk_bytes),
        data_start(info.data_start),
        file_bytes(info.file_bytes),
        read_start(info.data_start / kDataAlignment * kDataAlignment),
        chunks((info.file_bytes - read_start + chunk_bytes - 1) / chunk_bytes) {}
  std::uint64_t file_off(std::uint64_t k) const { return read_start + k * chunk; }
  // Bytes of the file in chunk k, and where its data bytes begin (header bytes before).
  std::uint64_t want(std::uint64_t k) const { return std::min(chunk, file_bytes - file_off(k)); }
  std::uint64_t from(std::uint64_t k) const { return k == 0 ? data_start - read_start : 0; }

  const std::uint64_t chunk, data_start, file_bytes, read_start, chunks;
};

// The pool chunks of one restore: the first `held` hold chunks 0..held-1 of the shard for
// the whole restore; the others are a window that the later chunks take in turn.
struct RestoreBufs {
  std::vector<HostPool::Chunk> chunks;
  std::size_t held = 0;
  std::size_t window() const { return chunks.size() - held; }
  std::size_t Of(std::uint64_t k) const {
    return k < held ? static_cast<std::size_t>(k) : held + static_cast<std::size_t>((k - held) % window());
  }
};

// Reads chunks begin..chunks-1 in order into their buffers, with up to `readers` reads in
// flight, and hands each to `visit` in order. `before_reuse(b)` runs before a read into the
// window buffer b (whose earlier chunk was visited). Returns the first error; every read has
// ended when it returns.
Status ReadChunks(const ShardBytes& src, const ChunkGeometry& g, std::uint64_t begin, const RestoreBufs& bufs,
                  unsigned readers, const std::string& what,
                  const std::function<Status(std::size_t)>& before_reuse,
                  const std::function<Status(std::uint64_t, const char*)>& visit) {
  const std::size_t in_flight = std::max(1u, readers);
  std::deque<std::future<Result<std::size_t>>> inflight;
  auto drain = [&] {
    for (auto& f : inflight) f.wait();
    inflight.clear();
  };
  std::uint64_t next = begin;
  for (std::uint64_t k = begin; k < g.chunks; ++k) {
    // A window buffer is read into again only once its earlier chunk was visited.
    while (next < g.chunks && inflight.size() < in_flight &&
           (next < bufs.held + bufs.window() || next - bufs.window() < k)) {
      const std::size_t b = bufs.Of(next);
      if (next >= bufs.held) {
        if (Status s = before_reuse(b); !s.ok()) {
          drain();
          return s;
        }
      }
      try {
        inflight.push_back(
            std::async(std::launch::async, [&src, &g, buf = bufs.chunks[b].data, off = g.file_off(next)] {
              return src.Read(off, buf, g.chunk);
            }));
      } catch (const std::system_error& e) {  // no thread could be started
        drain();
        return Internal(std::string("cannot start a reader thread: ") + e.what());
      }
      ++next;
    }
    auto got = inflight.front().get();
    inflight.pop_front();
    Status status = got.ok() ? Status::Ok() : got.status();
    if (status.ok() && got.value() < g.want(k)) status = DataLoss(what + " ended early (truncated shard)");
    if (status.ok()) status = visit(k, bufs.chunks[bufs.Of(k)].data);
    if (!status.ok()) {
      drain();
      return status;
    }
  }
  return Status::Ok();
}

// The copy lanes of one restore: the backend's for each device a target is on (chunk k
// goes to lane k % lanes of its device), a host lane for host regions.
class RestoreLanes {
 public:
  Status Make(const std::vector<RestoreTarget>& targets, DeviceBackend* backend, unsigned lanes) {
    for (const auto& t : targets) {
      const int device = t.region->device();
      if (device < 0 || by_device_.count(device) > 0) continue;
      if (backend == nullptr) {
        return FailedPrecondition("region " + t.region->name() +
                                  " is device memory, and this daemon has no device backend");
      }
      auto made = backend->MakeLanes(device, std::max(1u, lanes));
      if (!made.ok()) return made.status().With("create copy streams for a restore");
      by_device_[device] = std::move(made).value();
    }
    return Status::Ok();
  }
  CopyLane& For(const ImportedRegion& region, std::uint64_t chunk) {
    const int device = region.device();
    if (device < 0) return host_;
    auto& lanes = by_device_.at(device);
    return *lanes[chunk % lanes.size()];
  }

 private:
  HostCopyLane host_;
  std::map<int, std::vector<std::unique_ptr<CopyLane>>> by_device_;
};

// `s` with `note` (what the error left in the regions) appended.
Status Noted(const Status& s, const std::string& note) {
  return Status(s.code(), s.message() + " (" + note + ")");
}

// The copies of one chunk, queued and not yet waited for.
struct QueuedChunk {
  std::size_t buf = 0;
  std::vector<std::pair<CopyLane*, std::uint64_t>> tickets;
};

}  // namespace

// The restore in two steps: every item is verified in pool chunks before any byte reaches a
// region; then the chunks' tensor bytes are copied to the regions, per chunk, on the copy
// lanes (host-to-device on the daemon's streams, one event per chunk and lane).
Result<RestoredShard> RestoreEngine::Run(const std::string& what, const ShardInfo& info,
                                         const std::vector<RestoreTarget>& targets, const ShardBytes& src) {
  if (Status s = MatchLayout(info, targets); !s.ok()) return s;
  if (Status s = CheckBlobBytes(what, info, limits_); !s.ok()) return s;
  const auto started = std::chrono::steady_clock::now();
  RestoredShard out;
  ItemVerifier verifier(what, info, out);
  if (Status s = verifier.Begin(); !s.ok()) return s;
  const ChunkGeometry g(info, pool_.chunk_bytes());
  if (g.chunks == 0) return out;
  RestoreLanes lanes;
  if (Status s = lanes.Make(targets, backend_, lanes_); !s.ok()) return s;
  std::map<std::string, const RestoreTarget*> by_name;
  for (const auto& t : targets) by_name[t.item.name] = &t;
  std::vector<const RestoreTarget*> dest(info.items.size(), nullptr);  // null for blobs
  for (std::size_t i = 0; i < info.items.size(); ++i) {
    if (info.items[i].kind == ItemKind::kTensor) dest[i] = by_name.at(info.items[i].name);
  }

  // A chunk for each chunk of the shard if the pool has them now, else as many as it lends
  // (see the header). Only a restore holding no chunk may block for one (see HostPool).
  RestoreBufs bufs;
  struct ReleaseBufs {
    HostPool& pool;
    std::vector<HostPool::Chunk>& chunks;
    ~ReleaseBufs() {
      for (const auto& c : chunks) pool.Release(c);
    }
  } release{pool_, bufs.chunks};
  if (auto first = pool_.Acquire()) {
    bufs.chunks.push_back(*first);
  } else {
    return FailedPrecondition("daemon is shutting down");
  }
  const std::uint64_t wanted =
      src.image != nullptr ? std::min<std::uint64_t>(g.chunks, std::max(2u, readers_)) : g.chunks;
  while (bufs.chunks.size() < wanted) {
    auto more = pool_.TryAcquire();
    if (!more) break;
    bufs.chunks.push_back(*more);
  }
  // A file: the chunks it gets hold the shard's first chunks, but for a window of
  // `readers_` through which the rest passes twice. An image: all of them are a window.
  if (src.image == nullptr) {
    bufs.held = bufs.chunks.size() == g.chunks
                    ? bufs.chunks.size()
                    : bufs.chunks.size() - std::min<std::size_t>(bufs.chunks.size(), std::max(1u, readers_));
  }
  const auto no_wait = [](std::size_t) { return Status::Ok(); };

  // Pass 1: verify. A file's chunk that pass 2 reads again must hold the same bytes: its
  // hash is kept. An image does not change, and is verified where it lies.
  std::vector<std::uint64_t> chunk_sums(src.image != nullptr ? 0 : g.chunks - bufs.held);
  Status verified;
  if (src.image != nullptr) {
    for (std::uint64_t k = 0; k < g.chunks && verified.ok(); ++k) {
      verified = verifier.Consume(src.image->data() + g.file_off(k) + g.from(k), g.want(k) - g.from(k));
    }
  } else {
    verified = ReadChunks(src, g, 0, bufs, readers_, what, no_wait, [&](std::uint64_t k, const char* data) {
      if (k >= bufs.held) chunk_sums[k - bufs.held] = Checksum::Of(data, g.want(k));
      out.bytes_read += g.want(k) - g.from(k);
      return verifier.Consume(data + g.from(k), g.want(k) - g.from(k));
    });
  }
  if (!verified.ok()) return Noted(verified, "nothing was written to the registered regions");

  out.verify_ms = MsSince(started);
  const auto copy_started = std::chrono::steady_clock::now();
  // Pass 2: copy. Each chunk's tensor pieces are queued on its lanes, each lane's chunk
  // ended with one ticket; a chunk's memory is reused only once its tickets are waited for.
  std::deque<QueuedChunk> queued;
  Status copied;
  auto wait_oldest = [&] {
    for (auto& [lane, ticket] : queued.front().tickets) {
      Status s = lane->WaitChunk(ticket, [] { return false; });
      if (copied.ok() && !s.ok()) copied = s;
    }
    queued.pop_front();
  };
  std::size_t first_item = 0;
  auto queue_chunk = [&](std::uint64_t k, const char* data) -> Status {
    const std::uint64_t lo = g.file_off(k) + g.from(k) - g.data_start;
    const std::uint64_t hi = g.file_off(k) + g.want(k) - g.data_start;
    QueuedChunk q{bufs.Of(k), {}};
    std::vector<CopyLane*> used;
    Status s;
    // Chunks come in file order: items that end before this one are done for good.
    while (first_item < info.items.size() &&
           info.items[first_item].offset + info.items[first_item].length <= lo) {
      ++first_item;
    }
    for (std::size_t i = first_item; i < info.items.size() && info.items[i].offset < hi && s.ok(); ++i) {
      const ShardItem& it = info.items[i];
      if (dest[i] == nullptr || it.length == 0) continue;
      const std::uint64_t from = std::max(lo, it.offset), to = std::min(hi, it.offset + it.length);
      CopyLane& lane = lanes.For(*dest[i]->region, k);
      s = lane.CopyIn(*dest[i]->region, dest[i]->region_offset + (from - it.offset),
                      data + (from + g.data_start - g.file_off(k)), static_cast<std::size_t>(to - from));
      if (!s.ok()) s = s.With("restore item " + QuoteName(it.name));
      if (std::find(used.begin(), used.end(), &lane) == used.end()) used.push_back(&lane);
    }
    // Even after a failed copy, what was queued gets a ticket to wait for.
    for (CopyLane* lane : used) {
      auto ticket = lane->EndChunk();
      if (ticket.ok()) {
        q.tickets.emplace_back(lane, ticket.value());
      } else if (s.ok()) {
        s = ticket.status();
      }
    }
    queued.push_back(std::move(q));
    return s;
  };
  // The held chunks are copied from where they were verified; the rest is read again.
  for (std::uint64_t k = 0; k < bufs.held && copied.ok(); ++k) {
    if (Status s = queue_chunk(k, bufs.chunks[k].data); !s.ok()) copied = s;
  }
  if (copied.ok() && bufs.held < g.chunks) {
    Status read = ReadChunks(
        src, g, bufs.held, bufs, readers_, what,
        [&](std::size_t b) {
          while (copied.ok() && std::any_of(queued.begin(), queued.end(),
                                            [b](const QueuedChunk& q) { return q.buf == b; })) {
            wait_oldest();
          }
          return copied;
        },
        [&](std::uint64_t k, const char* data) -> Status {
          if (src.image == nullptr) {
            out.bytes_read += g.want(k) - g.from(k);
            // Not DATA_LOSS, which would try the next tier: the regions are partly
            // written now, and the error that reaches the trainer must say so.
            if (Checksum::Of(data, g.want(k)) != chunk_sums[k - bufs.held]) {
              return Status(StatusCode::kIoError,
                            what +
                                " changed between its verification and its copy (bytes from "
                                "file offset " +
                                std::to_string(g.file_off(k)) + ")");
            }
          }
          return queue_chunk(k, data);
        });
    if (copied.ok() && !read.ok()) copied = read;
  }
  // Every queued copy ends before the chunks go back to the pool.
  while (!queued.empty()) wait_oldest();
  if (!copied.ok()) return Noted(copied, "the registered regions are partly written: do not train on them");
  out.copy_ms = MsSince(copy_started);
  return out;
}

// A memory image into host regions. The image lies in memory and does not change, so it
// needs no pool chunk: each item is verified where it lies and then written to its region
// straight from there. Two phases keep the all-or-nothing rule: first every item is
// hashed (items spread over the threads) while one thread preallocates the destination
// ranges (a trainer's fresh shm object allocates its pages on first write, which is most
// of a restore's time; fallocate changes no byte); then the tensors are written, in pieces
// of a pool chunk, pieces of different regions side by side (the kernel serialises the
// writes into one shm object, not those into several).
Result<RestoredShard> RestoreEngine::RestoreImageToHost(const std::string& what, const ShardInfo& info,
                                                        const MemoryImage& image,
                                                        const std::vector<RestoreTarget>& targets) {
  if (Status s = MatchLayout(info, targets); !s.ok()) return s;
  if (Status s = CheckBlobBytes(what, info, limits_); !s.ok()) return s;
  RestoredShard out;
  std::map<std::string, const RestoreTarget*> by_name;
  for (const auto& t : targets) by_name[t.item.name] = &t;
  const char* data = image.data() + info.data_start;
  const std::size_t n_items = info.items.size();
  std::vector<std::string*> blob(n_items, nullptr);
  for (const auto& item : info.items) {
    if (item.kind == ItemKind::kBlob) {
      out.blobs.emplace_back(item.name, std::string());
    } else {
      out.tensor_bytes += item.length;
    }
  }
  for (std::size_t i = 0, b = 0; i < n_items; ++i) {
    if (info.items[i].kind == ItemKind::kBlob) blob[i] = &out.blobs[b++].second;
  }
  const unsigned threads =
      std::max(1u, std::min(readers_, std::max(1u, std::thread::hardware_concurrency())));

  const auto started = std::chrono::steady_clock::now();
  // Phase 1: verify every item; meanwhile allocate the destination.
  std::vector<Status> item_status(n_items);
  std::atomic<std::size_t> next_item{0};
  std::atomic<bool> mismatch{false}, preallocating{false};
  RunParallel(threads, [&] {
    // The first thread to start takes it (the caller starts the others first).
    if (!preallocating.exchange(true)) {
      const auto preallocate_started = std::chrono::steady_clock::now();
      for (const auto& t : targets) {
        if (!t.preallocated) t.region->Preallocate(t.region_offset, t.item.length);
      }
      out.preallocate_ms = MsSince(preallocate_started);
    }
    while (!mismatch.load()) {
      const std::size_t i = next_item.fetch_add(1);
      if (i >= n_items) break;
      const ShardItem& it = info.items[i];
      const std::uint64_t sum = Checksum::Of(data + it.offset, it.length);
      if (sum != it.checksum) {
        item_status[i] = DataLoss(what + ": checksum mismatch in item " + QuoteName(it.name) + " (stored " +
                                  ChecksumHex(it.checksum) + ", read " + ChecksumHex(sum) + ")");
        mismatch.store(true);
      } else if (blob[i] != nullptr) {
        blob[i]->assign(data + it.offset, it.length);
      }
    }
  });
  // Items are claimed in file order and each claimed one is finished: the first failure
  // in file order is the first mismatch of the shard.
  for (const Status& s : item_status) {
    if (!s.ok()) return Noted(s, "nothing was written to the registered regions");
  }

  out.verify_ms = MsSince(started);
  const auto copy_started = std::chrono::steady_clock::now();
  // Phase 2: write, one writer per region at a time: the kernel serialises the writes into
  // one object, and a second writer into it only spins on the object's lock, taking a core
  // from the first. Writers claim whole regions, the largest first; within a region the
  // pieces go in file order.
  struct Piece {
    const RestoreTarget* target;
    const ShardItem* item;
    std::uint64_t at;  // within the item
    std::size_t len;
  };
  std::map<const ImportedRegion*, std::vector<Piece>> per_region;
  std::map<const ImportedRegion*, std::uint64_t> region_bytes;
  const std::uint64_t piece = pool_.chunk_bytes();
  for (const auto& it : info.items) {
    if (it.kind != ItemKind::kTensor) continue;
    const RestoreTarget* t = by_name.at(it.name);
    region_bytes[t->region.get()] += it.length;
    for (std::uint64_t at = 0; at < it.length; at += piece) {
      per_region[t->region.get()].push_back(
          {t, &it, at, static_cast<std::size_t>(std::min(piece, it.length - at))});
    }
  }
  std::vector<const std::vector<Piece>*> lists;
  for (const auto& [region, list] : per_region) lists.push_back(&list);
  std::stable_sort(lists.begin(), lists.end(), [&](const auto* a, const auto* b) {
    return region_bytes[a->front().target->region.get()] > region_bytes[b->front().target->region.get()];
  });
  std::vector<Status> region_status(lists.size());
  std::atomic<std::size_t> next_region{0};
  std::atomic<bool> failed{false};
  const unsigned writers = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, lists.size())));
  RunParallel(writers, [&] {
    for (std::size_t r = next_region.fetch_add(1); r < lists.size() && !failed.load(); r = next_region.fetch_add(1)) {
      for (const Piece& p : *lists[r]) {
        Status s =
            p.target->region->WriteAt(p.target->region_offset + p.at, data + p.item->offset + p.at, p.len);
        if (!s.ok()) {
          region_status[r] = s.With("restore item " + QuoteName(p.item->name));
          failed.store(true);
          break;
        }
        if (failed.load()) break;
      }
    }
  });
  for (const Status& s : region_status) {
    if (!s.ok()) return Noted(s, "the registered regions are partly written: do not train on them");
  }
  out.copy_ms = MsSince(copy_started);
  return out;
}

Result<RestoredShard> RestoreEngine::Restore(const std::string& path,
                                             const std::vector<RestoreTarget>& targets, bool direct_io) {
  // One buffered descriptor for the header; an O_DIRECT one for the data is checked to be
  // the same file, so a shard renamed over the path in between is not read half and half.
  UniqueFd header_fd;
  if (auto opened = storage_->OpenForRead(path, /*direct=*/false); opened.ok()) {
    header_fd = std::move(opened.value());
  } else {
    return opened.status();
  }
  auto info = ReadShardHeader(header_fd.get(), path);
  if (!info.ok()) return info.status();
  if (Status s = MatchLayout(info.value(), targets); !s.ok()) return s;
  if (info->base) {
    // Differential: read buffered from the shard and its base, both held open.
    auto files = ShardFiles::Adopt(std::move(header_fd), std::move(info).value(), path);
    if (!files.ok()) return files.status();
    ShardInfo whole;
    ShardBytes src = WholeShard(storage_.get(), files.value(), &whole);
    return Run(path, whole, targets, src);
  }
  UniqueFd data_fd;
  if (!direct_io) {
    data_fd = std::move(header_fd);
  } else if (auto opened = storage_->OpenForRead(path, /*direct=*/true); opened.ok()) {
    data_fd = std::move(opened.value());
    struct stat a {
    }, b{};
    if (::fstat(header_fd.get(), &a) != 0 || ::fstat(data_fd.get(), &b) != 0 || a.st_ino != b.st_ino ||
        a.st_dev != b.st_dev) {
      return DataLoss(path + " was replaced while it was being restored");
    }
  } else {
    return opened.status();
  }
  ShardBytes src;
  src.storage = storage_.get();
  src.fd = data_fd.get();
  src.path = &path;
  return Run(path, info.value(), targets, src);
}

Result<RestoredShard> RestoreEngine::RestoreFromImage(const MemoryImage& image,
                                                      const std::vector<RestoreTarget>& targets) {
  const std::string what = "memory image of job '" + image.meta.job + "' version " +
                           std::to_string(image.meta.version) + " rank " + std::to_string(image.meta.rank);
  if (image.file_bytes < 8) return DataLoss(what + " is too short");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(image.data()[i]);
  if (header_len > image.file_bytes - 8) return DataLoss(what + ": header size past the end");
  auto info = ParseShardHeader(std::string_view(image.data() + 8, header_len), image.file_bytes);
  if (!info.ok()) return info.status().With(what);
  const bool host_only = std::all_of(targets.begin(), targets.end(),
                                     [](const RestoreTarget& t) { return t.region->device() < 0; });
  if (host_only) return RestoreImageToHost(what, info.value(), image, targets);
  ShardBytes src;
  src.image = &image;
  return Run(what, info.value(), targets, src);
}

}  // namespace ckpt
