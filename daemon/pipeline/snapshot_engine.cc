#include "daemon/pipeline/snapshot_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "common/test_pause.h"
#include "daemon/metrics/daemon_metrics.h"
#include "format/checksum.h"

namespace ckpt {
SnapshotEngine::SnapshotEngine(HostPool& pool, FlushEngine& flush, unsigned copiers, DeviceBackend* backend,
                               unsigned lanes)
    : pool_(pool), flush_(flush), backend_(backend), lanes_(lanes == 0 ? 1 : lanes) {
  copiers_ = std::make_unique<WorkerPool<std::shared_ptr<ShardJob>>>(
      copiers, [this](std::shared_ptr<ShardJob>& shard) {
        Copy(shard);
        flush_.CopyFinished(shard);
      });
}

SnapshotEngine::~SnapshotEngine() { Stop(); }

void SnapshotEngine::Stop() {
  {
    MutexLock lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  copiers_->Stop();
  // Device queues end when empty; no shard is queued after stopping_.
  std::map<std::string, std::unique_ptr<DeviceQueue>> device_queues;
  {
    MutexLock lock(mu_);
    device_queues.swap(device_queues_);
  }
  for (auto& [key, q] : device_queues) {
    if (q->thread.joinable()) q->thread.join();
  }
  ReapAbandoned(true);
}

void SnapshotEngine::Enqueue(std::shared_ptr<ShardJob> shard) {
  if (shard->device() >= 0) {
    MutexLock lock(mu_);
    // Queues whose thread has ended and that hold nothing go (sessions come and go).
    for (auto it = device_queues_.begin(); it != device_queues_.end();) {
      DeviceQueue& q = *it->second;
      if (!q.running && q.shards.empty()) {
        if (q.thread.joinable()) q.thread.join();  // it has left its loop
        it = device_queues_.erase(it);
      } else {
        ++it;
      }
    }
    auto& slot = device_queues_[shard->copy_queue()];
    if (!slot) slot = std::make_unique<DeviceQueue>();
    DeviceQueue* q = slot.get();
    q->shards.push_back(std::move(shard));
    if (!q->running) {
      if (q->thread.joinable()) q->thread.join();
      q->running = true;
      q->thread = std::thread([this, q] { DeviceLoop(q); });
    }
    return;
  }
  copiers_->Push(std::move(shard));
}

void SnapshotEngine::DeviceLoop(DeviceQueue* q) {
  for (;;) {
    std::shared_ptr<ShardJob> shard;
    {
      MutexLock lock(mu_);
      if (q->shards.empty()) {
        q->running = false;
        return;
      }
      shard = std::move(q->shards.front());
      q->shards.pop_front();
    }
    Copy(shard);
    flush_.CopyFinished(shard);
  }
}

namespace {

// A chunk whose copies are queued and not yet waited for.
struct PendingChunk {
  HostPool::Chunk chunk;
  std::size_t lane = 0;
  std::uint64_t ticket = 0;
  std::uint64_t data_off = 0;
  std::uint64_t fill = 0;
};

}  // namespace

void SnapshotEngine::Copy(const std::shared_ptr<ShardJob>& shard) {
  ReapAbandoned(false);
  TestPause("capture", shard->meta().version);
  // Last, once the shard is captured or failed: the older shards its Snapshot call let go.
  struct DropRetired {
    ShardJob& shard;
    ~DropRetired() { (void)shard.TakeRetired(); }
  } drop_retired{*shard};
  // Whatever happens, the daemon is done with this version's device events at the end.
  struct ReleaseSync {
    VersionSync* sync;
    ~ReleaseSync() {
      if (sync != nullptr) sync->Release();
    }
  } release_sync{shard->sync().get()};
  // Captured or failed, the shard no longer needs the trainer's memory (ShardJob::ReleaseSources).
  struct ReleaseSources {
    ShardJob& shard;
    ~ReleaseSources() { shard.ReleaseSources(); }
  } release_sources{*shard};

  // Planning (offsets, header size) happens here rather than in the Snapshot call, which
  // must return at once even for thousands of items.
  if (Status s = shard->Prepare(); !s.ok()) {
    shard->Fail(s);
    return;
  }
  std::vector<std::unique_ptr<CopyLane>> lanes;
  if (shard->device() >= 0) {
    if (backend_ == nullptr) {
      shard->Fail(FailedPrecondition("this daemon has no device backend for device regions"));
      return;
    }
    auto made = backend_->MakeLanes(shard->device(), lanes_);
    if (!made.ok()) {
      shard->Fail(made.status().With("create copy streams"));
      return;
    }
    lanes = std::move(made).value();
  } else {
    lanes.push_back(std::make_unique<HostCopyLane>());
  }
  const bool synchronous = lanes.front()->synchronous();
  // Whether the trainer's event has fired: known once a chunk has landed. Until then the
  // shard holds one chunk (see the file comment).
  bool flowing = synchronous;
  std::vector<bool> gated(lanes.size(), false);

  auto& items = shard->layout().items();
  const auto& sources = shard->sources();
  const std::uint64_t data_bytes = shard->layout().data_bytes();
  const std::uint64_t header_bytes = shard->layout().header_bytes();
  const std::uint64_t chunk_bytes = pool_.chunk_bytes();

  std::size_t item = 0;       // next item to copy
  std::uint64_t in_item = 0;  // bytes of it already queued
  std::uint64_t data_off = 0;
  std::deque<PendingChunk> pending;

  // Chunks of a failed shard. A device lane may still write into them (a copy queued
  // behind the event of a trainer that died), so they go back to the pool only once every
  // lane is idle; until then they are set aside with the lanes (see ReapAbandoned).
  std::vector<HostPool::Chunk> dropped;
  const std::function<bool()> give_up = [&] { return shard->failed(); };

  // Verify mode: the xxh3 of each host tensor item's part in a chunk, as copied, for the
  // sealing wait to compare with the trainer's memory then (the chunk is still in cache).
  // Items are packed in file order, so each chunk continues where the last one ended.
  const bool verify = shard->verify() && synchronous;
  std::size_t verify_item = 0;
  auto hash_pieces = [&](const PendingChunk& p) {
    const std::uint64_t begin = p.data_off, end = p.data_off + p.fill;
    while (verify_item < items.size() && items[verify_item].offset + items[verify_item].length <= begin) ++verify_item;
    for (std::size_t i = verify_item; i < items.size() && items[i].offset < end; ++i) {
      const ShardItem& it = items[i];
      if (it.length == 0 || !sources[i].region || sources[i].region->device() >= 0) continue;
      const std::uint64_t from = std::max(begin, it.offset), to = std::min(end, it.offset + it.length);
      if (from >= to) continue;
      shard->verify_pieces.push_back(VerifyPiece{static_cast<std::uint32_t>(i), from - it.offset, to - from,
                                                 Checksum::Of(p.chunk.data + (from - begin), to - from)});
    }
  };

  // Waits for the oldest pending chunk; on success hands it to the flush engine, whose
  // writers checksum it. A failed shard's chunks are not waited for.
  auto complete_oldest = [&] {
    PendingChunk p = pending.front();
    pending.pop_front();
    if (!shard->failed()) {
      Status s = lanes[p.lane]->WaitChunk(p.ticket, give_up);
      if (!s.ok()) shard->Fail(s.With("copy version " + std::to_string(shard->meta().version)));
    }
    if (shard->failed()) {
      dropped.push_back(p.chunk);
      return;
    }
    flowing = true;
    if (verify) hash_pieces(p);
    shard->copied_bytes.fetch_add(p.fill, std::memory_order_relaxed);
    metrics::Metrics().Copied(shard->device() >= 0, p.fill);
    flush_.Submit(shard, p.chunk, header_bytes + p.data_off, static_cast<std::size_t>(p.fill));
  };

  std::uint64_t chunk_index = 0;
  while (data_off < data_bytes && !shard->failed()) {
    // A synchronous lane has finished its chunk already: pass it on before the next. A
    // device shard whose first chunk has not landed waits for it before taking another.
    if ((synchronous || !flowing) && !pending.empty()) {
      complete_oldest();
      continue;
    }
    // A thread that holds chunks may only take more without blocking (see HostPool).
    auto chunk = pending.empty() ? pool_.Acquire() : pool_.TryAcquire();
    if (!chunk) {
      if (!pending.empty()) {
        complete_oldest();
        continue;
      }
      shard->Fail(FailedPrecondition("daemon is shutting down"));
      break;
    }
    const std::size_t lane_index = chunk_index % lanes.size();
    CopyLane& lane = *lanes[lane_index];
    Status status;
    if (shard->sync() && !gated[lane_index]) {
      status = shard->sync()->Gate(lane);
      gated[lane_index] = true;
    }
    const std::uint64_t fill = std::min(chunk_bytes, data_bytes - data_off);
    std::uint64_t filled = 0;
    while (filled < fill && status.ok()) {
      // One copy per (item ∩ chunk), extended over the next items while they continue the
      // same region at the next offset (the tensors of one allocation, packed as the
      // trainer laid them out).
      const ShardItem& it = items[item];
      const ItemSource& src = sources[item];
      char* dst = chunk->data + filled;
      if (src.blob) {
        const std::size_t n = static_cast<std::size_t>(std::min(fill - filled, it.length - in_item));
        std::memcpy(dst, src.blob->data() + in_item, n);
        filled += n;
        in_item += n;
      } else {
        const std::uint64_t from = src.region_offset + in_item;
        std::uint64_t n = 0;
        for (;;) {
          const std::uint64_t take = std::min(fill - filled - n, items[item].length - in_item);
          n += take;
          in_item += take;
          if (in_item < items[item].length) break;  // the chunk is full
          std::size_t next = item + 1;
          while (next < items.size() && items[next].length == 0) ++next;
          if (next == items.size() || n == fill - filled) break;
          const ItemSource& ns = sources[next];
          if (ns.blob || ns.region != src.region || ns.region_offset != from + n) break;
          item = next;  // empty items between are complete
          in_item = 0;
        }
        if (n > 0) {
          status = lane.CopyOut(*src.region, from, dst, static_cast<std::size_t>(n));
          if (!status.ok()) {
            status = status.With(&items[item] == &it ? "item " + it.name
                                                     : "items " + it.name + " to " + items[item].name);
          }
        }
        filled += n;
      }
      while (item < items.size() && in_item == items[item].length) {
        ++item;
        in_item = 0;
      }
    }
    auto ticket = status.ok() ? lane.EndChunk() : Result<std::uint64_t>(status);
    if (!ticket.ok()) {
      // Copies already queued on the lane may still be writing into the chunk.
      dropped.push_back(*chunk);
      shard->Fail(ticket.status());
      break;
    }
    pending.push_back(PendingChunk{*chunk, lane_index, ticket.value(), data_off, fill});
    data_off += fill;
    ++chunk_index;
  }
  if (shard->sync() && !shard->failed()) {
    // Every copy is queued: record the daemon's completion event after all of them.
    std::vector<CopyLane*> all;
    for (auto& l : lanes) all.push_back(l.get());
    if (Status s = shard->sync()->Signal(all); !s.ok()) {
      shard->Fail(s.With("record the completion event of version " + std::to_string(shard->meta().version)));
    } else {
      shard->MarkOrdered();
    }
  }
  while (!pending.empty()) complete_oldest();
  if (!shard->failed()) {
    if (verify) shard->KeepVerifySources();
    shard->Reach(Level::kCaptured);
    return;
  }
  bool idle = true;
  for (auto& l : lanes) idle = l->Idle() && idle;
  if (idle) {
    for (const auto& c : dropped) pool_.Release(c);
    return;
  }
  spdlog::warn(
      "job {} rank {} version {}: copies still queued behind the trainer's event; {} pool chunk(s) "
      "and {} copy stream(s) set aside until they drain",
      shard->meta().job, shard->meta().rank, shard->meta().version, dropped.size(), lanes.size());
  MutexLock lock(abandoned_mu_);
  abandoned_.push_back(Abandoned{std::move(lanes), std::move(dropped)});
}

void SnapshotEngine::ReapAbandoned(bool stopping) {
  MutexLock lock(abandoned_mu_);
  for (auto it = abandoned_.begin(); it != abandoned_.end();) {
    bool idle = true;
    for (auto& l : it->lanes) idle = l->Idle() && idle;
    if (idle) {
      for (const auto& c : it->chunks) pool_.Release(c);
      it = abandoned_.erase(it);
    } else if (stopping) {
      // A lane that never drains would block its own destruction: leave it to the process exit.
      for (auto& l : it->lanes) (void)l.release();
      it = abandoned_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace ckpt
