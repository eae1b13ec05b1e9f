// SnapshotEngine: copies each shard's items out of trainer memory into pool chunks, in
// file order, and hands every filled chunk to the flush engine, whose writers checksum it
// (daemon/pipeline/item_hasher.h): the copy thread only queues and waits for copies.
//
// In: shards queued by Snapshot calls. Out: chunks to the FlushEngine; the shard reaches
// `captured` when its last byte is out of trainer memory. When the pool is empty the copy
// waits for writes to return chunks (backpressure). Each shard is copied by one thread
// (so its chunks reach the writers in file order); several threads copy several shards
// at once.
//
// Each chunk gets one copy per (item ∩ chunk), and adjacent items that continue one region
// at the next offset (the tensors of one allocation) share a copy. Copies go through copy
// lanes (backend/device_copier.h). Host regions use one synchronous lane, one chunk in
// flight. Device regions use `lanes` lanes of the backend: chunk i is queued on lane
// i % lanes after the lane waited for the trainer's event; the copy thread queues as many
// chunks as the pool lends it, records the daemon's completion event once the last is
// queued (the shard is then `ordered`), and completes chunks oldest first: wait, hand to
// the flush engine.
//
// Device shards never block each other. Until its first chunk has landed (the trainer's
// event has fired) a device shard holds one pool chunk; and the device shards of each
// copy queue (one per registration) have a thread of their own, created on demand. A
// copy waiting for one rank's event (which, through collectives, may wait for another
// rank's GPU, which may wait on the daemon's completion event of that rank) therefore
// never holds the pool or the threads that the other rank's copies need.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/device_copier.h"
#include "common/mutex.h"
#include "daemon/pipeline/flush_engine.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/pipeline/worker_pool.h"

namespace ckpt {

class SnapshotEngine {
 public:
  // `backend` (may be null) provides the lanes of device regions; `lanes` per shard.
  SnapshotEngine(HostPool& pool, FlushEngine& flush, unsigned copiers, DeviceBackend* backend = nullptr,
                 unsigned lanes = 2);
  ~SnapshotEngine();

  void Enqueue(std::shared_ptr<ShardJob> shard);
  // Copies what is queued, then stops the threads.
  void Stop();
  // Gives back the chunks of failed device shards whose lanes have drained since (also
  // done before every copy). The service calls it periodically.
  void ReclaimAbandoned() { ReapAbandoned(false); }

 private:
  struct DeviceQueue {
    std::deque<std::shared_ptr<ShardJob>> shards;
    bool running = false;
    std::thread thread;
  };

  // Lanes of failed shards that were not idle, with the chunks their copies may still
  // write into; given back once idle (checked before every copy, and at Stop, where lanes
  // that never drain are left to the process exit).
  struct Abandoned {
    std::vector<std::unique_ptr<CopyLane>> lanes;
    std::vector<HostPool::Chunk> chunks;
  };
  void ReapAbandoned(bool stopping);

  void DeviceLoop(DeviceQueue* queue);
  void Copy(const std::shared_ptr<ShardJob>& shard);

  HostPool& pool_;
  FlushEngine& flush_;
  DeviceBackend* backend_;
  unsigned lanes_;
  Mutex mu_;
  bool stopping_ GUARDED_BY(mu_) = false;
  // By ShardJob::copy_queue.
  std::map<std::string, std::unique_ptr<DeviceQueue>> device_queues_ GUARDED_BY(mu_);
  Mutex abandoned_mu_;
  std::vector<Abandoned> abandoned_ GUARDED_BY(abandoned_mu_);
  // Host shards, copied by `copiers` threads; made last: its threads use the above.
  std::unique_ptr<WorkerPool<std::shared_ptr<ShardJob>>> copiers_;
};

}  // namespace ckpt
