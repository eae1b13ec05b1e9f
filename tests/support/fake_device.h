// A device without a device, for CPU tests of the snapshot engine's device path: copies
// queued on a lane complete later, on another thread, as CUDA copies on a stream do.
//
// FakeDeviceRegion is the trainer's GPU memory (bytes in host memory; DeviceAt hands out
// their addresses). FakeBackend is the DeviceBackend the engine gets: it only makes lanes,
// on device 0. Each lane is an AsyncLane, a "stream": one worker thread running queued
// operations in order. FakeDevice is what the lanes of one backend share: the lanes alive
// now and counters of what they queued and copied, which tests check.
//
// Thread-safety: FakeDevice's counters are atomic, and `mu` guards its lane set and
// chunks_per_lane. An AsyncLane is used by one engine thread at a time (CopyLane's
// contract); Enqueue, queued, WaitDone and Poke may be called from any thread. A
// FakeDeviceRegion reads like a MemoryRegion; Overwrite must not run while a lane copies
// from it (tests order it before the trainer's event, as the trainer's update is).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "backend/device_copier.h"
#include "support/latch.h"
#include "support/memory_region.h"

namespace ckpt::test {

// Bytes standing for GPU memory: DeviceAt hands out addresses for lanes to copy from and
// to. Its ReadAt and WriteAt stand for the CUDA region's synchronous copies (a copy, then
// a stream synchronise); writes() counts those writes, which a restore must not make.
class FakeDeviceRegion : public WritableRegion {
 public:
  using WritableRegion::WritableRegion;
  int device() const override { return 0; }
  // Fails once `closed` is set, as a CUDA region of a released client does.
  Result<DeviceSpan> DeviceAt(std::uint64_t offset, std::size_t len) const override;
  // Stands for the trainer's update, which the trainer's event orders before the copies.
  void Overwrite(const std::string& data);
  std::atomic<bool> closed{false};

 private:
  std::shared_ptr<const void> keep_ = std::make_shared<int>(0);
};

class AsyncLane;

struct FakeDevice {
  // The lanes alive now (each registers itself), to wake or drain them all.
  void Add(AsyncLane* lane) {
    std::lock_guard lock(mu);
    lanes.insert(lane);
  }
  void Remove(AsyncLane* lane) {
    std::lock_guard lock(mu);
    lanes.erase(lane);
  }
  // Wakes every lane's waits, so that a WaitChunk sees a shard given up.
  void PokeAll();
  // Blocks until every operation queued so far on every lane has run.
  void WaitAllIdle();
  std::set<AsyncLane*> lanes;

  Latch first_copy_queued;
  std::atomic<int> lanes_made{0};
  std::atomic<std::uint64_t> bytes_queued{0};
  std::atomic<std::uint64_t> bytes_done{0};
  // Device copies queued: device to host (CopyOut) and host to device (CopyIn, a restore).
  std::atomic<std::uint64_t> copies_out{0};
  std::atomic<std::uint64_t> copies_in{0};
  std::atomic<std::uint64_t> bytes_in_done{0};
  std::mutex mu;
  std::map<const void*, std::uint64_t> chunks_per_lane;
};

// A stream: a thread running queued operations in order.
class AsyncLane : public CopyLane {
 public:
  explicit AsyncLane(FakeDevice& device);
  // Runs what is still queued, then stops the worker.
  ~AsyncLane() override;

  bool synchronous() const override { return false; }
  void* native() const override { return const_cast<AsyncLane*>(this); }

  // Host regions are read at once; device regions are queued.
  Status CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) override;
  // Host regions are written at once; device regions are queued.
  Status CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src,
                std::size_t len) override;
  Result<std::uint64_t> EndChunk() override;
  Status WaitChunk(std::uint64_t ticket, const std::function<bool()>& give_up) override;
  bool Idle() override;
  // Wakes WaitChunk to ask its give_up() again.
  void Poke() { cv_.notify_all(); }
  // `other` must be an AsyncLane too.
  Status After(CopyLane& other) override;

  // Queues `op` to run on the worker after everything queued before.
  void Enqueue(std::function<void()> op);
  // How many operations were queued so far.
  std::uint64_t queued();
  // Blocks until `n` operations have run.
  void WaitDone(std::uint64_t n);

 private:
  void Run();

  FakeDevice& device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> ops_;
  std::uint64_t queued_ = 0, done_ = 0, tickets_ = 0;
  std::map<std::uint64_t, std::uint64_t> ticket_end_;
  bool stop_ = false;
  std::thread worker_;
};

// Makes AsyncLanes on device 0 that count into `fake`; nothing else is used by the engine.
class FakeBackend : public DeviceBackend {
 public:
  std::string Describe() const override { return "fake device"; }
  bool Owns(std::string_view) const override { return false; }
  Result<std::shared_ptr<ImportedRegion>> Import(const std::string&, pid_t, std::uint64_t) override {
    return Internal("not used");
  }
  void ReleaseClient(pid_t) override {}
  Status AwaitReleases(std::chrono::steady_clock::time_point) override { return Status::Ok(); }
  Result<std::unique_ptr<SessionEvents>> OpenSession(pid_t, const std::string&, const std::vector<std::string>&,
                                                     const TrainerReleaseWords*) override {
    return Internal("not used");
  }
  Result<std::vector<std::unique_ptr<CopyLane>>> MakeLanes(int device, std::uint32_t count) override;
  Status Pin(void*, std::size_t, int) override { return Status::Ok(); }
  void Unpin(void*) override {}
  FakeDevice fake;
};

}  // namespace ckpt::test
