// CallGate: the calls the service is running, so that shutdown need not wait for idle ones.
//
// Every handler enters the gate for its whole run. Once BeginShutdown() is called, new
// calls are refused (UNAVAILABLE "shutting down"), and the cancel check of every running
// call says true, so calls that wait (Wait, a Snapshot waiting for room, a Register waiting
// for a rank to settle, a Restore waiting for versions in flight) end within one wait slice
// (common/cancellable_wait.h) with UNAVAILABLE; AwaitIdle() returns once none runs. The
// server can then be shut down with a deadline just long enough for the last replies to be
// sent: only idle connections are left, and they are closed then. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <utility>

#include "common/cancellable_wait.h"
#include "common/mutex.h"
#include "common/status.h"

namespace ckpt {

class CallGate {
 public:
  // Held by a call while it runs.
  class Pass {
   public:
    explicit Pass(CallGate* gate) : gate_(gate) {}
    Pass(Pass&& other) noexcept : gate_(std::exchange(other.gate_, nullptr)) {}
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    Pass& operator=(Pass&&) = delete;
    ~Pass();

   private:
    CallGate* gate_;
  };

  // A pass for one call; nullopt once shutdown began (the call then answers Refusal()).
  std::optional<Pass> Enter() EXCLUDES(mu_);
  // UNAVAILABLE: the daemon is shutting down (a client library reconnects on this code).
  static grpc::Status Refusal();
  // True once the call's client went away or shutdown began.
  CancelCheck CancelCheckOf(grpc::ServerContext* ctx) const;
  // A call's result as a gRPC status (rpc/convert.h); a call cut off by shutdown gets
  // Refusal(), not "client went away".
  grpc::Status Reply(const Status& st) const;

  void BeginShutdown() EXCLUDES(mu_);
  bool shutting_down() const EXCLUDES(mu_);
  // Waits until no call runs, or `deadline`; returns the number still running.
  std::uint64_t AwaitIdle(std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);

 private:
  void Leave() EXCLUDES(mu_);

  mutable Mutex mu_;
  CondVar idle_cv_;
  bool shutting_down_ GUARDED_BY(mu_) = false;
  std::uint64_t running_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
