#include "daemon/rpc/call_gate.h"

#include "daemon/rpc/convert.h"

namespace ckpt {

CallGate::Pass::~Pass() {
  if (gate_) gate_->Leave();
}

std::optional<CallGate::Pass> CallGate::Enter() {
  MutexLock lock(mu_);
  if (shutting_down_) return std::nullopt;
  ++running_;
  return std::optional<Pass>(std::in_place, this);
}

grpc::Status CallGate::Refusal() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "ckptd is shutting down: the call was not finished (shards already in flight are "
                      "still written)");
}

void CallGate::Leave() {
  MutexLock lock(mu_);
  if (--running_ == 0) idle_cv_.SignalAll();
}

CancelCheck CallGate::CancelCheckOf(grpc::ServerContext* ctx) const {
  return [this, ctx] { return ctx->IsCancelled() || shutting_down(); };
}

grpc::Status CallGate::Reply(const Status& st) const {
  if (st.code() == StatusCode::kCancelled && shutting_down()) return Refusal();
  return ToGrpc(st);
}

void CallGate::BeginShutdown() {
  MutexLock lock(mu_);
  shutting_down_ = true;
}

bool CallGate::shutting_down() const {
  MutexLock lock(mu_);
  return shutting_down_;
}

std::uint64_t CallGate::AwaitIdle(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(mu_);
  while (running_ > 0) {
    if (!idle_cv_.WaitUntil(mu_, deadline) && std::chrono::steady_clock::now() >= deadline) break;
  }
  return running_;
}

}  // namespace ckpt
