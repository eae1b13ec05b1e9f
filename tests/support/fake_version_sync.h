// FakeSync: the device ordering of one version (a VersionSync) on the fake device of
// support/fake_device.h. Gate queues, on the lane, a wait for `trainer_event`, the stand-in
// for the trainer's interprocess event, which the test opens; Signal queues, after every
// lane's copies, the daemon's "completion event", which records how many bytes were copied
// by then and opens `completion`. It counts gates, signals and releases.
//
// Thread-safety: the engine calls Gate, Signal and Release from its copy threads; the
// counters are atomic and the latches thread-safe, so a test may read and wait on them
// from its own thread. The lanes passed in must be AsyncLanes of `device`.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "backend/device_copier.h"
#include "support/fake_device.h"
#include "support/latch.h"

namespace ckpt::test {

class FakeSync : public VersionSync {
 public:
  explicit FakeSync(FakeDevice& device) : device_(device) {}
  Status Gate(CopyLane& lane) override;
  Status Signal(const std::vector<CopyLane*>& lanes) override;
  void Release() override { ++releases; }
  std::uint32_t daemon_slot() const override { return 5; }

  Latch trainer_event;
  Latch completion;
  Latch gated;  // a lane was gated: the shard holds a chunk
  std::atomic<int> gates{0}, signals{0}, releases{0};
  std::atomic<std::uint64_t> bytes_queued_at_signal{0};
  std::atomic<std::uint64_t> bytes_done_at_completion{0};

 private:
  FakeDevice& device_;
};

}  // namespace ckpt::test
