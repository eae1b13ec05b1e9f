// DeviceReleaser: the daemon's one thread for giving device resources back: closing CUDA
// IPC mappings (cudaIpcCloseMemHandle) and unpinning the host pool (cudaHostUnregister).
//
// Why a thread of its own: both calls are reported to synchronise with the device, and a
// daemon stream may wait for ever on an interprocess event of a trainer that exited (the
// event was recorded behind work that will never run). Run on the reaper, a registration or
// any thread holding a lock others wait for, such a close would stall the daemon. Here it
// stalls only this thread, and the callers (Post) never wait for it.
//
// In: releases posted with the device they act on (-1: host memory usable from every
// device, e.g. the pool). Out: each release run once, in order, unless its device is
// "abandoned" when its turn comes (the `abandoned` predicate: a copy lane on that device
// waits on a dead trainer's event); then it is put off and retried every `recheck` until
// the device is clear. Releases still put off when the releaser stops are dropped: the
// process exit reclaims them.
//
// Thread-safety: all members are thread-safe. `abandoned` and the releases run on the
// releaser's thread, never under its lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "common/status.h"
#include "cuda/ipc_handle_cache.h"

namespace ckpt::cuda {

class DeviceReleaser {
  struct State;

 public:
  // `abandoned(device)` (device -1: any device) is asked before each release.
  explicit DeviceReleaser(std::function<bool(int device)> abandoned,
                          std::chrono::milliseconds recheck = std::chrono::milliseconds(50));
  // Stop() with a grace of kStopGrace.
  ~DeviceReleaser();
  DeviceReleaser(const DeviceReleaser&) = delete;
  DeviceReleaser& operator=(const DeviceReleaser&) = delete;

  static constexpr std::chrono::seconds kStopGrace{2};

  // Queues `release` for device `device`; never blocks on a running release. After Stop,
  // releases are dropped.
  void Post(int device, std::function<void()> release);

  // Blocks until every release posted before the call has run or been put off, or until
  // `deadline`: Ok, FailedPrecondition naming how many are put off (and why), or
  // DeadlineExceeded when one is still running or queued (a release that blocks).
  Status AwaitPosted(std::chrono::steady_clock::time_point deadline);

  // Runs what is queued (skipping put-off releases) until `deadline`, then stops the thread.
  // A thread still inside a release by then is left behind (detached): it can only be
  // blocked in the driver, and the process is about to exit.
  void Stop(std::chrono::steady_clock::time_point deadline);

  struct Counts {
    std::uint64_t posted = 0;
    std::uint64_t run = 0;
    std::uint64_t put_off = 0;  // waiting now for their device to be clear
  };
  Counts counts() const;

 private:
  std::shared_ptr<State> state_;
};

// An IpcOpener whose closes run on a DeviceReleaser: opens go to `inner` at once (they are
// part of a registration); Close posts `inner`'s close for the mapping's device and returns.
class ReleasingOpener final : public IpcOpener {
 public:
  ReleasingOpener(std::shared_ptr<IpcOpener> inner, std::shared_ptr<DeviceReleaser> releaser)
      : inner_(std::move(inner)), releaser_(std::move(releaser)) {}
  Result<IpcMapping> Open(const IpcHandle& handle, int device) override {
    return inner_->Open(handle, device);
  }
  Status Close(const IpcMapping& mapping) override {
    releaser_->Post(mapping.device, [inner = inner_, mapping] { (void)inner->Close(mapping); });
    return Status::Ok();
  }

 private:
  std::shared_ptr<IpcOpener> inner_;
  std::shared_ptr<DeviceReleaser> releaser_;
};

}  // namespace ckpt::cuda
