// FlushEngine: writes filled pool chunks to their shard files and publishes each shard.
//
// In: (shard, chunk, file offset, length) from the snapshot engine, in file order per
// shard but written by several threads at once (writes in flight). Each writer hashes
// the items of the chunk it wrote (daemon/pipeline/item_hasher.h), so checksums take
// several cores and none of the copy thread's time. Out: chunks back to
// the pool; a shard that is complete gets its header (with the checksums), its exact
// size, fdatasync, rename from .tmp, and an fsync of its directory, then the `durable`
// callback. A failed write fails the shard, removes its .tmp, and never touches other
// files. Thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/io/storage.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/pipeline/worker_pool.h"
#include "daemon/tiers/memory_tier.h"

namespace ckpt {

class FlushEngine {
 public:
  using ShardCallback = std::function<void(const std::shared_ptr<ShardJob>&)>;

  // `on_durable` runs (on a writer thread) once a shard is durable, before its waiters wake; `on_failed`
  // after a shard failed and its temporary file was removed. With `memory` (may be null), each shard gets a
  // memory-tier image when it is opened, if the tier has room, and the writers fill it as they write.
  FlushEngine(std::shared_ptr<Storage> storage, HostPool& pool, unsigned writers, ShardCallback on_durable,
              ShardCallback on_failed, MemoryTier* memory = nullptr);
  ~FlushEngine();

  // Creates the shard's version directory and temporary file, once per shard, whoever
  // calls first (a writer with the first chunk, or the publish of an empty shard). Kept
  // off the copy path: capture never waits for mkdir or file creation.
  Status Open(ShardJob& shard);
  // Queues `len` bytes of `chunk` for writing at `file_offset`; the chunk returns to the
  // pool once written (or dropped because the shard failed).
  void Submit(std::shared_ptr<ShardJob> shard, HostPool::Chunk chunk, std::uint64_t file_offset,
              std::size_t len);
  // The snapshot engine is done with `shard` (successfully or not).
  void CopyFinished(const std::shared_ptr<ShardJob>& shard);
  // A shard of a sealed registration that waited, written, for its seal was sealed or
  // aborted (ShardJob::Seal or Abort told the caller to finish it): a writer publishes it,
  // or removes its temporary file, as it would have right after its last write.
  void Resume(std::shared_ptr<ShardJob> shard);

  // Finishes queued writes and stops the threads.
  void Stop();

 private:
  struct Task {
    std::shared_ptr<ShardJob> shard;
    HostPool::Chunk chunk;  // data null: finish the shard (Resume)
    std::uint64_t file_offset;
    std::size_t len;
  };

  // One queued write (a writer thread).
  void Write(Task& task);
  void Finish(const std::shared_ptr<ShardJob>& shard);
  Status Publish(ShardJob& shard);

  std::shared_ptr<Storage> storage_;
  HostPool& pool_;
  ShardCallback on_durable_, on_failed_;
  MemoryTier* memory_;
  std::unique_ptr<WorkerPool<Task>> writers_;  // made last: its threads use the above
};

}  // namespace ckpt
