// libckpt: the client side of the ckpt.v1 API (see ckpt/client.h for the contract): the
// public ckpt::Client methods.
//
// In: the trainer's calls. Out: gRPC calls to ckptd over its Unix socket, the descriptor
// table in shared memory, and, for GPU tensors, CUDA IPC exports and interprocess events
// (client/cuda_tensors.h). Errors are thrown as ckpt::Error, as the public API promises.
// The state behind a Client, its locking and its reconnection after a daemon restart are
// in client/session.h; register_items is in client/registration.cc.
#include "ckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client/errors.h"
#include "client/session.h"
#include "common/mutex.h"
#include "common/socket_path.h"

namespace ckpt {

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&& other) noexcept {
  if (this != &other) {
    if (impl_) {
      try {
        unregister();  // the registration being replaced ends, as in the destructor
      } catch (const Error&) {
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Client::~Client() {
  if (!impl_) return;
  try {
    unregister();
  } catch (const Error&) {
    // The daemon may be gone; the registration dies with it.
  }
}

Client Client::connect(const std::string& socket_path, const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->socket_path = socket_path.empty() ? DefaultClientSocketPath() : socket_path;
  impl->reconnect_budget = ReconnectBudget(options);
  impl->initial_backoff = options.reconnect_initial_backoff;
  impl->max_backoff = options.reconnect_max_backoff;
  {
    MutexLock lock(impl->mu);
    impl->stub = NewStub(impl->socket_path);
  }
  return Client(std::move(impl));
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

std::chrono::milliseconds Client::reconnect_budget() const { return impl_->reconnect_budget; }

std::string Client::stream_wait() const {
  MutexLock lock(impl_->mu);
  if (!impl_->cuda || impl_->session.empty()) return "none: no GPU registration with a daemon";
  if (impl_->words_in_use) return "release words";
  return "daemon events: " + impl_->words_unused;
}

void Client::snapshot(std::uint64_t version, const std::vector<Blob>& blobs, void* cuda_stream) {
  const std::string what = "snapshot " + std::to_string(version);
  bool retried = false;  // after a daemon restart found by this call
  const std::int64_t stall_ns = impl_->unreported_stall_ns.exchange(-1, std::memory_order_relaxed);
  for (;;) {
    v1::SnapshotRequest req;
    if (stall_ns >= 0) req.set_previous_stall_ns(static_cast<std::uint64_t>(stall_ns));
    Impl::Call call;
    {
      MutexLock lock(impl_->mu);
      for (;;) {
        impl_->EnsureSessionLocked(what);
        // Versions a daemon restart lost are reported before the next snapshot is taken,
        // as the daemon reports a background failure.
        if (impl_->lost.HasUnreported()) {
          const std::string note = impl_->RefreshLostLocked();
          if (auto report =
                  impl_->lost.Report(std::nullopt, note + "; reported now; this snapshot of version " +
                                                       std::to_string(version) + " was not taken")) {
            throw *report;
          }
        }
        impl_->CheckRegionsLocked();
        if (!impl_->cuda) break;
        // GPU tensors too: one freed, or reallocated elsewhere, is not what the daemon
        // imported.
        if (Status s = impl_->cuda->Revalidate(); !s.ok()) ThrowWithCode(s.With(what));
        const std::optional<std::uint64_t> holder = impl_->trainer_slots.MustWaitFor();
        if (!holder) break;
        // The daemon may still wait on the next trainer event for version `holder` (the
        // trainer made no wait on it): wait until the daemon is past it. The version's
        // failure, if any, reached the trainer already (the daemon refuses the next snapshot
        // after a failure it has not reported), so it only frees the slot here.
        const Impl::Call waiting = impl_->CallLocked();
        lock.Unlock();
        v1::WaitReply rep;
        grpc::Status ws = CallWait(*waiting.stub, waiting.session, *holder, v1::LEVEL_CAPTURED,
                                   std::chrono::milliseconds(0), false, &rep);
        const bool gone = !ws.ok() && Impl::DaemonGone(ws, waiting);
        lock.Lock();
        if (waiting.epoch != impl_->epoch || impl_->session.empty()) continue;  // another session now
        if (gone) {
          impl_->DropSessionLocked();  // a new daemon waits on none of the old events
          continue;
        }
        if (!WaitReleasesSlot(ws.error_code())) {
          Throw(ws, what + ": waiting for version " + std::to_string(*holder) + " to release its CUDA event");
        }
        impl_->trainer_slots.Release(*holder);
      }
      req.set_session(impl_->session);
      req.set_table_generation(impl_->table->generation());
      if (impl_->cuda) {
        const std::uint32_t slot = impl_->trainer_slots.next_slot();
        if (Status s = impl_->cuda->RecordTrainerEvent(slot, cuda_stream); !s.ok())
          ThrowWithCode(s.With(what));
        impl_->trainer_slots.Take(version);
        req.set_trainer_event_slot(slot);
      }
      // The daemon may give this version the next release value: the floor covers it before
      // the request leaves (client/release_words.h).
      if (impl_->cuda && impl_->words) impl_->words->NoteSnapshotSent();
      // From now on wait_snapshot_on_stream of older versions waits on the host (the daemon
      // may record their event slots again). After a rollback versions restart lower.
      impl_->last_snapshot = version;
      call = impl_->CallLocked();
    }
    req.set_version(version);
    for (const auto& b : blobs) {
      auto* pb = req.add_blobs();
      pb->set_name(b.name);
      pb->set_data(b.data);
      if (b.for_rank) pb->set_for_rank(*b.for_rank);
    }
    grpc::ClientContext ctx;
    v1::SnapshotReply rep;
    grpc::Status s = call.stub->Snapshot(&ctx, req, &rep);
    if (s.ok()) {
      impl_->SnapshotTaken(call, version);
      return;
    }
    // A daemon stopping gracefully may have taken and committed the version before it
    // refused the call: the restarted one then refuses it as not above the newest commit.
    if (retried && s.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
        impl_->CommittedAfterRestart(version)) {
      return;
    }
    // The state is still that of `version` (the trainer is inside this call): it is taken
    // again by the restarted daemon.
    if (!Impl::DaemonGone(s, call)) Throw(s, what);
    impl_->Recover(call, what + ": " + s.error_message());
    retried = true;
  }
}

std::chrono::nanoseconds Client::wait_snapshot(std::uint64_t version, std::chrono::milliseconds timeout,
                                               bool seal) {
  auto start = std::chrono::steady_clock::now();
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  (void)impl_->Wait(version, Level::kCaptured, timeout, false, "wait_snapshot " + std::to_string(version),
                    &used, &ordered, &rep, seal);
  return impl_->NoteStall(std::chrono::steady_clock::now() - start);
}

void Client::report_stall(std::chrono::nanoseconds stall) { (void)impl_->NoteStall(stall); }

void Client::abort_snapshot(std::uint64_t version, const std::string& reason) {
  const std::string what = "abort_snapshot " + std::to_string(version);
  Impl::Call c = impl_->Current(what);
  grpc::ClientContext ctx;
  v1::AbortRequest req;
  v1::AbortReply rep;
  req.set_session(c.session);
  req.set_version(version);
  req.set_reason(reason);
  grpc::Status s = c.stub->Abort(&ctx, req, &rep);
  if (s.ok()) return;
  if (!Impl::DaemonGone(s, c)) Throw(s, what);
  // The session a daemon restart ended never published the version: nothing is left to
  // abort. The client registers again, as any call does after a restart.
  impl_->Recover(c, what + ": " + s.error_message());
}

std::chrono::nanoseconds Client::wait_snapshot_on_stream(std::uint64_t version, void* cuda_stream,
                                                         bool seal) {
  auto start = std::chrono::steady_clock::now();
  const std::string what = "wait_snapshot_on_stream " + std::to_string(version);
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  const bool by_daemon = impl_->Wait(version, Level::kCaptured, std::chrono::milliseconds(0), true, what,
                                     &used, &ordered, &rep, seal);
  // Without an event the copies had finished when the daemon answered.
  if (by_daemon && ordered && rep.has_daemon_event()) {
    // The release word, which this client can satisfy itself should the daemon die before
    // its copies run; the daemon's event where the words are not in use.
    if (used.words && rep.release_value() != 0) {
      auto waited = used.cuda->WaitReleaseWord(&used.words->word(rep.daemon_event_slot()),
                                               rep.release_value(), cuda_stream);
      if (!waited.ok()) ThrowWithCode(waited.status().With(what));
      if (waited.value()) return impl_->NoteStall(std::chrono::steady_clock::now() - start);
      impl_->ReleaseWordsUnsupported(used);
    }
    if (Status st = used.cuda->WaitDaemonEvent(rep.daemon_event_slot(), cuda_stream); !st.ok()) {
      ThrowWithCode(st.With(what));
    }
  }
  return impl_->NoteStall(std::chrono::steady_clock::now() - start);
}

void Client::wait_durable(std::uint64_t version, Level level, std::chrono::milliseconds timeout) {
  Impl::Call used;
  bool ordered = false;
  v1::WaitReply rep;
  // A wait for durability implies the wait for the capture, and seals as that one does.
  (void)impl_->Wait(version, level, timeout, false, "wait_durable " + std::to_string(version), &used,
                    &ordered, &rep, /*seal=*/true);
}

RestoreResult Client::restore(std::optional<std::uint64_t> version) {
  const std::string what =
      version ? "restore version " + std::to_string(*version) : std::string("restore latest");
  for (;;) {
    Impl::Call c = impl_->Current(what);
    // The daemon writes GPU tensors into the allocations it imported: one freed since
    // registration may hold other data now.
    if (c.cuda) {
      if (Status st = c.cuda->Revalidate(); !st.ok()) ThrowWithCode(st.With("restore"));
      // The daemon writes on its own streams, which are not ordered after work the trainer
      // still has queued on these tensors (initialisation, a copy from the host).
      if (Status st = c.cuda->SynchronizeDevice(); !st.ok()) ThrowWithCode(st.With("restore"));
    }
    grpc::ClientContext ctx;
    v1::RestoreRequest req;
    v1::RestoreReply rep;
    req.set_session(c.session);
    req.set_version(version.value_or(0));
    grpc::Status s = c.stub->Restore(&ctx, req, &rep);
    if (!s.ok()) {
      // A restore cut off by the daemon going away is made again, whole, by the new one.
      if (!Impl::DaemonGone(s, c)) Throw(s, what);
      impl_->Recover(c, what + ": " + s.error_message());
      continue;
    }
    RestoreResult out;
    out.version = rep.version();
    out.tensor_bytes = rep.tensor_bytes();
    out.tier = rep.tier();
    out.world_size = rep.world_size();
    out.resharded = rep.resharded();
    out.uncommitted = rep.uncommitted();
    for (const auto& b : rep.blobs()) {
      out.blobs.push_back(Blob{b.name(), b.data(), std::nullopt, b.from_rank()});
      if (b.has_for_rank()) out.blobs.back().for_rank = b.for_rank();
    }
    return out;
  }
}

DaemonStatus Client::status() {
  std::shared_ptr<v1::Checkpoint::Stub> stub;
  {
    MutexLock lock(impl_->mu);
    stub = impl_->stub;
  }
  grpc::ClientContext ctx;
  v1::StatusRequest req;
  v1::StatusReply rep;
  grpc::Status s = stub->Status(&ctx, req, &rep);
  if (!s.ok()) Throw(s, "status");
  DaemonStatus out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(rep, &out.json, opts);
  return out;
}

void Client::unregister() { unregister(false); }

void Client::unregister(bool job_finished) {
  MutexLock lock(impl_->mu);
  impl_->lost.Clear();
  if (impl_->session.empty()) {
    impl_->EndSessionLocked();  // a registration whose daemon went away ends here too
    return;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(impl_->session);
  req.set_finished(job_finished);
  impl_->DrainGpuLocked();
  std::shared_ptr<v1::Checkpoint::Stub> stub = impl_->stub;
  impl_->EndSessionLocked();
  grpc::Status s = stub->Unregister(&ctx, req, &rep);
  // A session unknown to the daemon, or a daemon gone, ended the registration already.
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND &&
      s.error_code() != grpc::StatusCode::UNAVAILABLE) {
    Throw(s, "unregister");
  }
}

}  // namespace ckpt
