// SnapshotEngine: copies each shard's items out of trainer memory into pool chunks, in
// file order, checksumming on the way, and hands every filled chunk to the flush engine.
//
// In: shards queued by Snapshot calls. Out: chunks to the FlushEngine; the shard reaches
// `captured` when its last byte is out of trainer memory. When the pool is empty the copy
// waits for writes to return chunks (backpressure). Each shard is copied by one thread
// (so its checksums stream in order); several threads copy several shards at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "daemon/flush_engine.h"
#include "daemon/host_pool.h"
#include "daemon/shard_job.h"

namespace ckpt {

class SnapshotEngine {
 public:
  SnapshotEngine(HostPool& pool, FlushEngine& flush, unsigned copiers);
  ~SnapshotEngine();

  void Enqueue(std::shared_ptr<ShardJob> shard);
  // Copies what is queued, then stops the threads.
  void Stop();

 private:
  void CopyLoop();
  void Copy(const std::shared_ptr<ShardJob>& shard);

  HostPool& pool_;
  FlushEngine& flush_;
  std::mutex mu_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<ShardJob>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ckpt
