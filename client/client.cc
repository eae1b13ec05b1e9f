// libckpt: the client side of the ckpt.v1 API (see ckpt/client.h for the contract).
//
// In: the trainer's calls. Out: gRPC calls to ckptd over its Unix socket, the descriptor
// table in shared memory, and, for GPU tensors, CUDA IPC exports and interprocess events
// (client/cuda_tensors.h). Errors are thrown as ckpt::Error, as the public API promises.
// Thread-safety: a mutex guards the registration. Register runs under it; the RPCs that
// may block for long (Wait, Snapshot, Restore) run outside it.
#include "ckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <tuple>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client/cuda_tensors.h"
#include "common/mutex.h"
#include "common/socket_path.h"
#include "format/dtype.h"
#include "proto/level_codec.h"
#include "shm/descriptor_table.h"
#include "shm/shm_region.h"

namespace ckpt {

namespace {

[[noreturn]] void Throw(const grpc::Status& s, const std::string& what) {
  std::string msg = what + ": " + s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) msg += " (is ckptd running?)";
  throw Error(static_cast<int>(s.error_code()), msg);
}

[[noreturn]] void Throw(const Status& s) {
  throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION), s.message());
}

[[noreturn]] void ThrowWithCode(const Status& s) { throw Error(GrpcCodeNumber(s.code()), s.message()); }

class PosixSharedRegion : public SharedRegion {
 public:
  explicit PosixSharedRegion(ShmRegion r) : region_(std::move(r)) {}
  void* data() const override { return region_.data(); }
  std::size_t size() const override { return region_.size(); }
  const std::string& name() const override { return region_.name(); }
  std::uint64_t generation() const override { return region_.generation(); }
  void resize(std::size_t bytes) override {
    if (Status s = region_.Resize(bytes); !s.ok()) Throw(s);
  }
  std::optional<std::uint64_t> object_size() const { return region_.ObjectSize(); }

 private:
  ShmRegion region_;
};

std::uint64_t ElementSize(DType t) { return DTypeSize(t); }

// Unregisters `session`, best effort: used where the client drops a session on its own.
void UnregisterQuietly(v1::Checkpoint::Stub& stub, const std::string& session) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(session);
  (void)stub.Unregister(&ctx, req, &rep);
}

}  // namespace

#if !defined(CKPT_HAVE_CUDA)
Result<std::shared_ptr<CudaTensors>> ResolveCudaTensors(const std::vector<CudaTensorSpec>& tensors) {
  return FailedPrecondition("GPU tensor '" + (tensors.empty() ? std::string() : tensors.front().name) +
                            "': this libckpt was built without CUDA; rebuild it where the CUDA toolkit is "
                            "installed, or keep the tensor in a ckpt::SharedRegion");
}
#endif

std::shared_ptr<SharedRegion> SharedRegion::create(std::size_t bytes, const std::string& name) {
  auto r = ShmRegion::Create(name, bytes);
  if (!r.ok()) Throw(r.status());
  return std::make_shared<PosixSharedRegion>(std::move(r).value());
}

struct Client::Impl {
  std::string socket_path;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Checkpoint::Stub> stub;

  Mutex mu;  // guards the registration
  std::string session GUARDED_BY(mu);
  std::optional<DescriptorTable> table GUARDED_BY(mu);
  struct Registered {
    std::shared_ptr<SharedRegion> region;
    std::uint64_t generation;
    std::size_t size;
    std::string item;
  };
  std::vector<Registered> registered GUARDED_BY(mu);
  // The GPU side of the registration; null when it has no GPU tensors. Shared so that a
  // call in flight keeps it alive across a concurrent re-registration.
  std::shared_ptr<CudaTensors> cuda GUARDED_BY(mu);
  TrainerSlotBook trainer_slots GUARDED_BY(mu);
  std::uint64_t last_snapshot GUARDED_BY(mu) = 0;  // newest version passed to snapshot() in this session

  // Before a GPU session ends: the daemon may still be about to wait on the trainer's
  // events or copy from the tensors of its newest version (and so, in order, of every older
  // one). Waits until that version is captured or failed, so that the trainer may then
  // destroy its events and free the tensors.
  void DrainGpuLocked() REQUIRES(mu) {
    if (!cuda || last_snapshot == 0 || session.empty()) return;
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    v1::WaitReply rep;
    req.set_session(session);
    req.set_version(last_snapshot);
    req.set_level(v1::LEVEL_CAPTURED);
    (void)stub->Wait(&ctx, req, &rep);  // a failed version is as good as a captured one here
  }

  void EndSessionLocked() REQUIRES(mu) {
    session.clear();
    cuda.reset();
    trainer_slots = TrainerSlotBook();
    last_snapshot = 0;
  }

  // A Wait RPC on `version`, made in session `in_session`, returned `code`: when the daemon
  // is past the version, its trainer event slot is free again.
  void WaitReturned(const std::string& in_session, std::uint64_t version, grpc::StatusCode code) {
    MutexLock lock(mu);
    if (in_session == session && WaitReleasesSlot(code)) trainer_slots.Release(version);
  }

  // The session, its GPU side and its newest snapshot, read together; throws if not registered.
  std::tuple<std::string, std::shared_ptr<CudaTensors>, std::uint64_t> Current() {
    MutexLock lock(mu);
    if (session.empty()) {
      throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                  "not registered: call register_items first");
    }
    return {session, cuda, last_snapshot};
  }

  std::string Session() {
    MutexLock lock(mu);
    if (session.empty())
      throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                  "not registered: call register_items first");
    return session;
  }
};

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

Client Client::connect(const std::string& socket_path) {
  auto impl = std::make_unique<Impl>();
  impl->socket_path = socket_path.empty() ? DefaultClientSocketPath() : socket_path;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  impl->channel =
      grpc::CreateCustomChannel("unix:" + impl->socket_path, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::Checkpoint::NewStub(impl->channel);
  return Client(std::move(impl));
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

Registration Client::register_items(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                                    const std::vector<TensorItem>& items) {
  MutexLock lock(impl_->mu);
  std::vector<TableItem> rows;
  std::vector<Impl::Registered> registered;
  std::vector<CudaTensorSpec> gpu_tensors;
  std::vector<std::size_t> gpu_rows;  // index in `rows` of each GPU tensor
  for (const auto& it : items) {
    if (it.region && it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has both a region and a cuda_ptr: set one of them");
    }
    if (!it.region && !it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has no region");
    }
    std::uint64_t elems = 1;
    for (auto d : it.shape) {
      if (d < 0)
        throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                    "item '" + it.name + "' has a negative dimension");
      elems *= static_cast<std::uint64_t>(d);
    }
    TableItem row;
    row.name = it.name;
    row.dtype = it.dtype;
    row.shape = it.shape;
    row.length = elems * ElementSize(it.dtype);
    if (it.cuda_ptr) {
      // Region, offset and generation come from the tensor's CUDA allocation, below.
      gpu_rows.push_back(rows.size());
      gpu_tensors.push_back(CudaTensorSpec{it.name, it.cuda_ptr, row.length});
      rows.push_back(std::move(row));
      continue;
    }
    row.region = it.region->name();
    row.offset = it.offset;
    row.generation = it.region->generation();
    rows.push_back(std::move(row));
    // One entry per distinct region: the check before each snapshot is per region.
    bool seen = false;
    for (const auto& r : registered) seen = seen || r.region == it.region;
    if (!seen) registered.push_back({it.region, it.region->generation(), it.region->size(), it.name});
  }
  // GPU tensors are checked and exported before anything changes: a refused registration
  // leaves the previous one in place.
  std::shared_ptr<CudaTensors> gpu;
  if (!gpu_tensors.empty()) {
    auto resolved = ResolveCudaTensors(gpu_tensors);
    if (!resolved.ok()) ThrowWithCode(resolved.status());
    gpu = std::move(resolved).value();
    for (std::size_t i = 0; i < gpu_rows.size(); ++i) {
      TableItem& row = rows[gpu_rows[i]];
      row.region = gpu->rows()[i].region;
      row.offset = gpu->rows()[i].offset;
      row.generation = gpu->rows()[i].generation;
    }
  }
  bool new_session = !impl_->table || impl_->table->capacity() < rows.size();
  bool kept_events = false;
  if (gpu) {
    const CudaTensors* previous = new_session || impl_->session.empty() ? nullptr : impl_->cuda.get();
    auto kept = gpu->PrepareEvents(previous);
    if (!kept.ok()) ThrowWithCode(kept.status().With("register"));
    kept_events = kept.value();
  }
  // A session keeps the CUDA side it registered with (device, trainer events): the daemon
  // may still be waiting on those events. When that side changes, a new session starts.
  if ((gpu || impl_->cuda) && !kept_events) new_session = true;
  if (!impl_->table || impl_->table->capacity() < rows.size()) {
    auto table =
        DescriptorTable::Create("", static_cast<std::uint32_t>(std::max<std::size_t>(rows.size(), 16)));
    if (!table.ok()) Throw(table.status());
    impl_->table = std::move(table).value();
  }
  if (new_session && !impl_->session.empty()) {
    // A new table object, or another CUDA side, means a new registration.
    impl_->DrainGpuLocked();
    UnregisterQuietly(*impl_->stub, impl_->session);
    impl_->EndSessionLocked();
  }
  if (Status s = impl_->table->Write(rows); !s.ok()) Throw(s);
  impl_->registered = std::move(registered);
  impl_->cuda = gpu;
  if (gpu && !kept_events) impl_->trainer_slots = TrainerSlotBook(kTrainerEventSlots);
  // First registration, or (same table, new generation) a re-registration that the daemon
  // validates now rather than at the next snapshot.
  grpc::ClientContext ctx;
  v1::RegisterRequest req;
  v1::RegisterReply rep;
  req.set_job(job);
  req.set_rank(rank);
  req.set_world_size(world_size);
  req.set_descriptor_table(impl_->table->name());
  req.set_session(impl_->session);
  if (gpu) {
    v1::CudaSession* cuda = req.mutable_cuda();
    cuda->set_device_uuid(gpu->device_uuid());
    for (std::string& h : gpu->trainer_event_handles()) cuda->add_trainer_events(std::move(h));
  }
  grpc::Status s = impl_->stub->Register(&ctx, req, &rep);
  if (!s.ok()) Throw(s, impl_->session.empty() ? "register" : "re-register");
  impl_->session = rep.session();
  if (gpu) {
    std::vector<std::string> handles(rep.daemon_events().begin(), rep.daemon_events().end());
    if (Status st = gpu->OpenDaemonEvents(handles); !st.ok()) {
      // Without the daemon's events no stream could be ordered after its copies: end the
      // registration rather than leave it half made.
      UnregisterQuietly(*impl_->stub, impl_->session);
      impl_->EndSessionLocked();
      ThrowWithCode(st.With("register"));
    }
  }
  Registration out;
  out.item_count = rep.item_count();
  out.tensor_bytes = rep.tensor_bytes();
  out.latest_committed = rep.latest_committed();
  return out;
}

namespace {

// One Wait RPC. The caller notes its return (Impl::WaitReturned) before throwing.
grpc::Status CallWait(v1::Checkpoint::Stub& stub, const std::string& session, std::uint64_t version,
                      v1::Level level, std::chrono::milliseconds timeout, bool stream_ordered,
                      v1::WaitReply* rep) {
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  req.set_session(session);
  req.set_version(version);
  req.set_level(level);
  req.set_timeout_ms(static_cast<std::uint64_t>(timeout.count()));
  req.set_stream_ordered(stream_ordered);
  return stub.Wait(&ctx, req, rep);
}

}  // namespace

void Client::snapshot(std::uint64_t version, const std::vector<Blob>& blobs, void* cuda_stream) {
  v1::SnapshotRequest req;
  {
    MutexLock lock(impl_->mu);
    for (;;) {
      if (impl_->session.empty()) {
        throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                    "not registered: call register_items first");
      }
      // A region that was resized (or shrunk by someone else) since registration would make
      // the daemon copy memory that no longer holds the registered tensor.
      for (const auto& r : impl_->registered) {
        auto* posix = dynamic_cast<PosixSharedRegion*>(r.region.get());
        const std::optional<std::uint64_t> now = posix != nullptr ? posix->object_size() : std::nullopt;
        bool shrunk = now && *now != r.size;
        if (r.region->generation() != r.generation || r.region->size() != r.size || shrunk) {
          throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                      "region " + r.region->name() + " of item '" + r.item +
                          "' changed since registration (resized or reallocated); call register_items again");
        }
      }
      if (!impl_->cuda) break;
      // The same for GPU tensors: one freed, or reallocated elsewhere, is not what the
      // daemon imported.
      if (Status s = impl_->cuda->Revalidate(); !s.ok())
        ThrowWithCode(s.With("snapshot " + std::to_string(version)));
      const std::optional<std::uint64_t> holder = impl_->trainer_slots.MustWaitFor();
      if (!holder) break;
      // The daemon may still wait on the next trainer event for version `holder` (the
      // trainer made no wait on it): wait until the daemon is past it. The version's
      // failure, if any, reached the trainer already (the daemon refuses the next snapshot
      // after a failure it has not reported), so it only frees the slot here.
      const std::string session = impl_->session;
      lock.Unlock();
      v1::WaitReply rep;
      grpc::Status ws = CallWait(*impl_->stub, session, *holder, v1::LEVEL_CAPTURED,
                                 std::chrono::milliseconds(0), false, &rep);
      lock.Lock();
      if (session != impl_->session) continue;  // re-registered meanwhile: check everything again
      if (!WaitReleasesSlot(ws.error_code())) {
        Throw(ws, "snapshot " + std::to_string(version) + ": waiting for version " + std::to_string(*holder) +
                      " to release its CUDA event");
      }
      impl_->trainer_slots.Release(*holder);
    }
    req.set_session(impl_->session);
    req.set_table_generation(impl_->table->generation());
    if (impl_->cuda) {
      const std::uint32_t slot = impl_->trainer_slots.next_slot();
      if (Status s = impl_->cuda->RecordTrainerEvent(slot, cuda_stream); !s.ok()) {
        ThrowWithCode(s.With("snapshot " + std::to_string(version)));
      }
      impl_->trainer_slots.Take(version);
      req.set_trainer_event_slot(slot);
    }
    // From now on wait_snapshot_on_stream of older versions waits on the host (the daemon
    // may record their event slots again). After a rollback versions restart lower.
    impl_->last_snapshot = version;
  }
  req.set_version(version);
  for (const auto& b : blobs) {
    auto* pb = req.add_blobs();
    pb->set_name(b.name);
    pb->set_data(b.data);
  }
  grpc::ClientContext ctx;
  v1::SnapshotReply rep;
  grpc::Status s = impl_->stub->Snapshot(&ctx, req, &rep);
  if (!s.ok()) Throw(s, "snapshot " + std::to_string(version));
}

std::chrono::nanoseconds Client::wait_snapshot(std::uint64_t version, std::chrono::milliseconds timeout) {
  auto start = std::chrono::steady_clock::now();
  const std::string session = impl_->Session();
  v1::WaitReply rep;
  grpc::Status s = CallWait(*impl_->stub, session, version, v1::LEVEL_CAPTURED, timeout, false, &rep);
  impl_->WaitReturned(session, version, s.error_code());
  if (!s.ok()) Throw(s, "wait_snapshot " + std::to_string(version));
  return std::chrono::steady_clock::now() - start;
}

std::chrono::nanoseconds Client::wait_snapshot_on_stream(std::uint64_t version, void* cuda_stream) {
  auto start = std::chrono::steady_clock::now();
  auto [session, cuda, last_snapshot] = impl_->Current();
  if (!UseStreamOrderedWait(cuda != nullptr, last_snapshot, version)) return wait_snapshot(version);
  v1::WaitReply rep;
  grpc::Status s =
      CallWait(*impl_->stub, session, version, v1::LEVEL_CAPTURED, std::chrono::milliseconds(0), true, &rep);
  impl_->WaitReturned(session, version, s.error_code());
  if (!s.ok()) Throw(s, "wait_snapshot_on_stream " + std::to_string(version));
  // Without an event the copies had finished when the daemon answered.
  if (rep.has_daemon_event()) {
    if (Status st = cuda->WaitDaemonEvent(rep.daemon_event_slot(), cuda_stream); !st.ok()) {
      ThrowWithCode(st.With("wait_snapshot_on_stream " + std::to_string(version)));
    }
  }
  return std::chrono::steady_clock::now() - start;
}

void Client::wait_durable(std::uint64_t version, Level level, std::chrono::milliseconds timeout) {
  const std::string session = impl_->Session();
  v1::WaitReply rep;
  grpc::Status s = CallWait(*impl_->stub, session, version, LevelToProto(level), timeout, false, &rep);
  impl_->WaitReturned(session, version, s.error_code());
  if (!s.ok()) Throw(s, "wait_durable " + std::to_string(version));
}

RestoreResult Client::restore(std::optional<std::uint64_t> version) {
  auto [session, cuda, last_snapshot] = impl_->Current();
  // The daemon writes GPU tensors into the allocations it imported: one freed since
  // registration may hold other data now.
  if (cuda) {
    if (Status st = cuda->Revalidate(); !st.ok()) ThrowWithCode(st.With("restore"));
    // The daemon writes on its own streams, which are not ordered after work the trainer
    // still has queued on these tensors (initialisation, a copy from the host).
    if (Status st = cuda->SynchronizeDevice(); !st.ok()) ThrowWithCode(st.With("restore"));
  }
  grpc::ClientContext ctx;
  v1::RestoreRequest req;
  v1::RestoreReply rep;
  req.set_session(session);
  req.set_version(version.value_or(0));
  grpc::Status s = impl_->stub->Restore(&ctx, req, &rep);
  if (!s.ok())
    Throw(s, version ? "restore version " + std::to_string(*version) : std::string("restore latest"));
  RestoreResult out;
  out.version = rep.version();
  out.tensor_bytes = rep.tensor_bytes();
  out.tier = rep.tier();
  for (const auto& b : rep.blobs()) out.blobs.push_back(Blob{b.name(), b.data()});
  return out;
}

DaemonStatus Client::status() {
  grpc::ClientContext ctx;
  v1::StatusRequest req;
  v1::StatusReply rep;
  grpc::Status s = impl_->stub->Status(&ctx, req, &rep);
  if (!s.ok()) Throw(s, "status");
  DaemonStatus out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(rep, &out.json, opts);
  return out;
}

void Client::unregister() {
  MutexLock lock(impl_->mu);
  if (impl_->session.empty()) return;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(impl_->session);
  impl_->DrainGpuLocked();
  impl_->EndSessionLocked();
  grpc::Status s = impl_->stub->Unregister(&ctx, req, &rep);
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) Throw(s, "unregister");
}

}  // namespace ckpt
