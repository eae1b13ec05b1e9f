#include "daemon/snapshot_engine.h"

#include <algorithm>
#include <cstring>

#include "format/checksum.h"

namespace ckpt {
namespace {

// Copy and checksum in pieces that stay in cache between the two passes.
constexpr std::uint64_t kPieceBytes = 1 << 20;

}  // namespace

SnapshotEngine::SnapshotEngine(HostPool& pool, FlushEngine& flush, unsigned copiers)
    : pool_(pool), flush_(flush) {
  for (unsigned i = 0; i < copiers; ++i) threads_.emplace_back([this] { CopyLoop(); });
}

SnapshotEngine::~SnapshotEngine() { Stop(); }

void SnapshotEngine::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  queued_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void SnapshotEngine::Enqueue(std::shared_ptr<ShardJob> shard) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(shard));
  }
  queued_.notify_one();
}

void SnapshotEngine::CopyLoop() {
  for (;;) {
    std::shared_ptr<ShardJob> shard;
    {
      std::unique_lock lock(mu_);
      queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      shard = std::move(queue_.front());
      queue_.pop_front();
    }
    Copy(shard);
    flush_.CopyFinished(shard);
  }
}

void SnapshotEngine::Copy(const std::shared_ptr<ShardJob>& shard) {
  // Planning (offsets, header size) happens here rather than in the Snapshot call, which
  // must return at once even for thousands of items.
  if (Status s = shard->Prepare(); !s.ok()) {
    shard->Fail(s);
    return;
  }
  auto& items = shard->layout().items();
  const auto& sources = shard->sources();
  const std::uint64_t data_bytes = shard->layout().data_bytes();
  const std::uint64_t header_bytes = shard->layout().header_bytes();
  const std::uint64_t chunk_bytes = pool_.chunk_bytes();

  std::size_t item = 0;       // current item
  std::uint64_t in_item = 0;  // bytes of it already copied
  Checksum sum;
  std::uint64_t data_off = 0;
  auto finish_items = [&] {
    // Closes every item that is complete at the current position, including empty ones.
    while (item < items.size() && in_item == items[item].length) {
      items[item].checksum = sum.Digest();
      sum = Checksum();
      ++item;
      in_item = 0;
    }
  };
  finish_items();
  while (data_off < data_bytes) {
    if (shard->failed()) return;
    auto chunk = pool_.Acquire();
    if (!chunk) {
      shard->Fail(FailedPrecondition("daemon is shutting down"));
      return;
    }
    const std::uint64_t fill = std::min(chunk_bytes, data_bytes - data_off);
    std::uint64_t filled = 0;
    Status status;
    while (filled < fill && status.ok()) {
      const ShardItem& it = items[item];
      const ItemSource& src = sources[item];
      std::size_t n = static_cast<std::size_t>(
          std::min({fill - filled, it.length - in_item, kPieceBytes}));
      char* dst = chunk->data + filled;
      if (src.blob) {
        std::memcpy(dst, src.blob->data() + in_item, n);
      } else {
        status = src.region->ReadAt(src.region_offset + in_item, dst, n);
        if (!status.ok()) status = status.With("item " + it.name);
      }
      sum.Update(dst, n);
      filled += n;
      in_item += n;
      finish_items();
    }
    if (!status.ok()) {
      pool_.Release(*chunk);
      shard->Fail(status);
      return;
    }
    shard->copied_bytes.fetch_add(fill, std::memory_order_relaxed);
    flush_.Submit(shard, *chunk, header_bytes + data_off, static_cast<std::size_t>(fill));
    data_off += fill;
  }
  shard->Reach(ShardLevel::kCaptured);
}

}  // namespace ckpt
