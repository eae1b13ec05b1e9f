#include "ckpt/client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <mutex>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "common/socket_path.h"
#include "format/dtype.h"
#include "shm/descriptor_table.h"
#include "shm/shm_region.h"

namespace ckpt {

namespace {

[[noreturn]] void Throw(const grpc::Status& s, const std::string& what) {
  std::string msg = what + ": " + s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) msg += " (is ckptd running?)";
  throw Error(static_cast<int>(s.error_code()), msg);
}

[[noreturn]] void Throw(const Status& s) { throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION), s.message()); }

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
  int fd() const { return region_.fd(); }

 private:
  ShmRegion region_;
};

std::uint64_t ElementSize(DType t) { return DTypeSize(t); }

}  // namespace

std::shared_ptr<SharedRegion> SharedRegion::create(std::size_t bytes, const std::string& name) {
  auto r = ShmRegion::Create(name, bytes);
  if (!r.ok()) Throw(r.status());
  return std::make_shared<PosixSharedRegion>(std::move(r).value());
}

struct Client::Impl {
  std::string socket_path;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Checkpoint::Stub> stub;

  std::mutex mu;  // guards the registration
  std::string session;
  std::optional<DescriptorTable> table;
  struct Registered {
    std::shared_ptr<SharedRegion> region;
    std::uint64_t generation;
    std::size_t size;
    std::string item;
  };
  std::vector<Registered> registered;

  std::string Session() {
    std::lock_guard lock(mu);
    if (session.empty()) throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
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
  impl->channel = grpc::CreateCustomChannel("unix:" + impl->socket_path, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::Checkpoint::NewStub(impl->channel);
  return Client(std::move(impl));
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

Registration Client::register_items(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                                    const std::vector<TensorItem>& items) {
  std::lock_guard lock(impl_->mu);
  std::vector<TableItem> rows;
  std::vector<Impl::Registered> registered;
  for (const auto& it : items) {
    if (!it.region) throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT), "item '" + it.name + "' has no region");
    std::uint64_t elems = 1;
    for (auto d : it.shape) {
      if (d < 0) throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT), "item '" + it.name + "' has a negative dimension");
      elems *= static_cast<std::uint64_t>(d);
    }
    TableItem row;
    row.name = it.name;
    row.dtype = it.dtype;
    row.shape = it.shape;
    row.region = it.region->name();
    row.offset = it.offset;
    row.length = elems * ElementSize(it.dtype);
    row.generation = it.region->generation();
    rows.push_back(std::move(row));
    // One entry per distinct region: the check before each snapshot is per region.
    bool seen = false;
    for (const auto& r : registered) seen = seen || r.region == it.region;
    if (!seen) registered.push_back({it.region, it.region->generation(), it.region->size(), it.name});
  }
  if (!impl_->table || impl_->table->capacity() < rows.size()) {
    auto table = DescriptorTable::Create("", static_cast<std::uint32_t>(std::max<std::size_t>(rows.size(), 16)));
    if (!table.ok()) Throw(table.status());
    impl_->table = std::move(table).value();
    if (!impl_->session.empty()) {
      // A new table object means a new registration.
      grpc::ClientContext ctx;
      v1::UnregisterRequest req;
      v1::UnregisterReply rep;
      req.set_session(impl_->session);
      impl_->stub->Unregister(&ctx, req, &rep);
      impl_->session.clear();
    }
  }
  if (Status s = impl_->table->Write(rows); !s.ok()) Throw(s);
  impl_->registered = std::move(registered);
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
  grpc::Status s = impl_->stub->Register(&ctx, req, &rep);
  if (!s.ok()) Throw(s, impl_->session.empty() ? "register" : "re-register");
  impl_->session = rep.session();
  Registration out;
  out.item_count = rep.item_count();
  out.tensor_bytes = rep.tensor_bytes();
  out.latest_committed = rep.latest_committed();
  return out;
}

void Client::snapshot(std::uint64_t version, const std::vector<Blob>& blobs) {
  v1::SnapshotRequest req;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->session.empty()) {
      throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION), "not registered: call register_items first");
    }
    // A region that was resized (or shrunk by someone else) since registration would make
    // the daemon copy memory that no longer holds the registered tensor.
    for (const auto& r : impl_->registered) {
      auto* posix = dynamic_cast<PosixSharedRegion*>(r.region.get());
      struct stat st {};
      bool shrunk = posix != nullptr && ::fstat(posix->fd(), &st) == 0 &&
                    static_cast<std::size_t>(st.st_size) != r.size;
      if (r.region->generation() != r.generation || r.region->size() != r.size || shrunk) {
        throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                    "region " + r.region->name() + " of item '" + r.item +
                        "' changed since registration (resized or reallocated); call register_items again");
      }
    }
    req.set_session(impl_->session);
    req.set_table_generation(impl_->table->generation());
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

namespace {

void WaitLevel(v1::Checkpoint::Stub& stub, const std::string& session, std::uint64_t version, v1::Level level,
               std::chrono::milliseconds timeout, const char* what) {
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  v1::WaitReply rep;
  req.set_session(session);
  req.set_version(version);
  req.set_level(level);
  req.set_timeout_ms(static_cast<std::uint64_t>(timeout.count()));
  grpc::Status s = stub.Wait(&ctx, req, &rep);
  if (!s.ok()) Throw(s, std::string(what) + " " + std::to_string(version));
}

}  // namespace

std::chrono::nanoseconds Client::wait_snapshot(std::uint64_t version, std::chrono::milliseconds timeout) {
  auto start = std::chrono::steady_clock::now();
  WaitLevel(*impl_->stub, impl_->Session(), version, v1::LEVEL_CAPTURED, timeout, "wait_snapshot");
  return std::chrono::steady_clock::now() - start;
}

void Client::wait_durable(std::uint64_t version, Level level, std::chrono::milliseconds timeout) {
  WaitLevel(*impl_->stub, impl_->Session(), version, static_cast<v1::Level>(level), timeout, "wait_durable");
}

RestoreResult Client::restore(std::optional<std::uint64_t> version) {
  grpc::ClientContext ctx;
  v1::RestoreRequest req;
  v1::RestoreReply rep;
  req.set_session(impl_->Session());
  req.set_version(version.value_or(0));
  grpc::Status s = impl_->stub->Restore(&ctx, req, &rep);
  if (!s.ok()) Throw(s, version ? "restore version " + std::to_string(*version) : std::string("restore latest"));
  RestoreResult out;
  out.version = rep.version();
  out.tensor_bytes = rep.tensor_bytes();
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
  std::lock_guard lock(impl_->mu);
  if (impl_->session.empty()) return;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterRequest req;
  v1::UnregisterReply rep;
  req.set_session(impl_->session);
  impl_->session.clear();
  grpc::Status s = impl_->stub->Unregister(&ctx, req, &rep);
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) Throw(s, "unregister");
}

}  // namespace ckpt
