#include "daemon/pipeline/flush_engine.h"
#include "common/align.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "common/test_pause.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/tiers/memory_tier.h"
#include "format/paths.h"

namespace ckpt {
namespace {

// The tier a shard's file is written to (the memory tier's image is counted apart).
metrics::TierLabel FirstTier(const ShardJob& shard) {
  return shard.publish_level() == Level::kLocal ? metrics::TierLabel::kLocal
                                                : metrics::TierLabel::kPersistent;
}

}  // namespace

FlushEngine::FlushEngine(std::shared_ptr<Storage> storage, HostPool& pool, unsigned writers,
                         ShardCallback on_durable, ShardCallback on_failed, MemoryTier* memory)
    : storage_(std::move(storage)),
      pool_(pool),
      on_durable_(std::move(on_durable)),
      on_failed_(std::move(on_failed)),
      memory_(memory) {
  writers_ = std::make_unique<WorkerPool<Task>>(writers, [this](Task& task) { Write(task); });
}

FlushEngine::~FlushEngine() { Stop(); }

void FlushEngine::Stop() { writers_->Stop(); }

Status FlushEngine::Open(ShardJob& shard) {
  std::call_once(shard.open_once(), [&] {
    // Publish() makes the directory entry durable.
    if (Status s = storage_->MakeDirs(shard.dir()); !s.ok()) {
      shard.open_status() = s;
      return;
    }
    auto fd = storage_->CreateFile(shard.tmp_path(), shard.direct_io());
    if (!fd.ok()) {
      shard.open_status() = fd.status();
      return;
    }
    shard.file() = std::move(fd).value();
    // Every writer opens the shard before its first write, so all of them see the image.
    if (memory_ != nullptr && shard.layout().planned()) {
      shard.image = memory_->Reserve(shard.meta(), shard.layout().file_bytes());
    }
  });
  return shard.open_status();
}

void FlushEngine::Submit(std::shared_ptr<ShardJob> shard, HostPool::Chunk chunk, std::uint64_t file_offset,
                         std::size_t len) {
  shard->AddPendingWrite();
  writers_->Push(Task{std::move(shard), chunk, file_offset, len});
}

void FlushEngine::CopyFinished(const std::shared_ptr<ShardJob>& shard) {
  if (shard->CopyDone() && shard->ClaimFinish()) Finish(shard);
}

void FlushEngine::Resume(std::shared_ptr<ShardJob> shard) {
  writers_->Push(Task{std::move(shard), HostPool::Chunk{}, 0, 0});
}

void FlushEngine::Write(Task& task) {
  ShardJob& shard = *task.shard;
  if (task.chunk.data == nullptr) {
    Finish(task.shard);
    return;
  }
  bool hashed = false;
  if (!shard.failed()) {
    if (Status s = Open(shard); !s.ok()) shard.FailWriting(s);
  }
  if (!shard.failed()) {
    // With O_DIRECT the tail of the last chunk is written padded to a whole block; the
    // file is cut to its exact size when the shard is published.
    std::size_t len = shard.direct_io() ? AlignUp(task.len, kDataAlignment) : task.len;
    if (len > task.len) std::memset(task.chunk.data + task.len, 0, len - task.len);
    Status s =
        storage_->WriteAt(shard.file().get(), task.chunk.data, len, task.file_offset, shard.tmp_path());
    if (s.ok()) {
      // The memory tier's copy, while the chunk is at hand.
      if (shard.image) {
        std::memcpy(shard.image->data() + task.file_offset, task.chunk.data, len);
        metrics::Metrics().Written(metrics::TierLabel::kMemory, task.len);
      }
      shard.written_bytes.fetch_add(task.len, std::memory_order_relaxed);
      metrics::Metrics().Written(FirstTier(shard), task.len);
      // Hashed after the write is issued, so that the writes of a shard stay in flight
      // together while its item pieces are hashed in order (see ItemHasher). False only
      // when an earlier chunk's writer gave up: the shard has failed.
      hashed =
          shard.hasher().Hash(task.file_offset - shard.layout().header_bytes(), task.chunk.data, task.len);
    } else {
      shard.FailWriting(s);
    }
  }
  // The writers of later chunks may be waiting for this chunk's pieces.
  if (!hashed) shard.hasher().Abort();
  pool_.Release(task.chunk);
  if (shard.WriteDone() && shard.ClaimFinish()) Finish(task.shard);
}

void FlushEngine::Finish(const std::shared_ptr<ShardJob>& shard) {
  if (!shard->failed()) {
    if (Status s = Publish(*shard); !s.ok()) shard->FailWriting(s);
  }
  if (shard->failed()) {
    shard->file().reset();
    storage_->Remove(shard->tmp_path());  // harmless if it was never created
    if (on_failed_) on_failed_(shard);
    return;
  }
  // Before the hook, which may promote and commit it: whoever sees the commit sees this.
  metrics::Metrics().Flushed(
      FirstTier(*shard),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - shard->created).count());
  // Commit runs before waiters of `durable` wake, so a waiter sees the commit decision.
  if (on_durable_) on_durable_(shard);
  if (shard->failed()) {  // e.g. its done marker could not be written
    if (on_failed_) on_failed_(shard);
    return;
  }
  shard->Reach(shard->publish_level());
}

Status FlushEngine::Publish(ShardJob& shard) {
  if (Status s = Open(shard); !s.ok()) return s;  // a shard without data chunks
  const ShardLayout& layout = shard.layout();
  std::string header = layout.RenderHeader();
  // O_DIRECT needs an aligned buffer; the header is a whole number of blocks.
  void* raw = nullptr;
  if (::posix_memalign(&raw, kDataAlignment, header.size()) != 0) {
    return ResourceExhausted("cannot allocate a header buffer");
  }
  std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
  std::memcpy(raw, header.data(), header.size());
  int fd = shard.file().get();
  const std::string& what = shard.tmp_path();
  if (Status s = storage_->WriteAt(fd, raw, header.size(), 0, what); !s.ok()) return s;
  if (shard.image) std::memcpy(shard.image->data(), header.data(), header.size());
  if (shard.direct_io() && layout.file_bytes() % kDataAlignment != 0) {
    if (Status s = storage_->Truncate(fd, layout.file_bytes(), what); !s.ok()) return s;
  }
  if (Status s = storage_->DataSync(fd, what); !s.ok()) return s;
  shard.file().reset();
  TestPause("publish", shard.meta().version);
  // A committed version is immutable: never replace one of its shards.
  if (storage_->Exists(JoinPath(shard.dir(), kCommittedMarker))) {
    return FailedPrecondition("version " + std::to_string(shard.meta().version) +
                              " is already committed; its shard is not replaced");
  }
  if (Status s = storage_->Rename(shard.tmp_path(), shard.final_path()); !s.ok()) return s;
  Status synced = storage_->SyncDir(shard.dir());
  if (synced.ok()) synced = storage_->SyncDir(shard.dir().substr(0, shard.dir().find_last_of('/')));
  if (!synced.ok()) {
    // The file has its final name but is not known to be durable: a commit must not count
    // it, so it goes.
    storage_->Remove(shard.final_path());
  }
  return synced;
}

}  // namespace ckpt
