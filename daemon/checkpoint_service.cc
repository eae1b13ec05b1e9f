#include "daemon/checkpoint_service.h"

#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <set>
#include <unordered_set>

#include "common/names.h"
#include "format/paths.h"
#include "proto/level_codec.h"

namespace ckpt {

namespace {

constexpr std::size_t kRecentShards = 64;
constexpr std::size_t kRecentErrors = 32;
constexpr std::size_t kVersionsKeptPerSession = 16;
constexpr std::uint32_t kMaxWorldSize = 1u << 20;
// Versions have at most 18 digits, so version directory names always parse back.
constexpr std::uint64_t kMaxVersion = 999'999'999'999'999'999ull;
// Versions of one registration that may be in flight (not yet durable or failed) at once.
// Beyond that the trainer is outrunning its storage: the Snapshot call waits (backpressure),
// so queued versions and their blobs cannot grow without bound.
constexpr std::size_t kMaxInFlightPerSession = 32;
// Waits longer than this are waits without limit (and never overflow a deadline).
constexpr std::uint64_t kMaxWaitMs = 30ull * 24 * 3600 * 1000;

grpc::Status ToGrpc(const ckpt::Status& s) {
  using grpc::StatusCode;
  StatusCode code = StatusCode::UNKNOWN;
  switch (s.code()) {
    case ckpt::StatusCode::kOk: return grpc::Status::OK;
    case ckpt::StatusCode::kInvalidArgument: code = StatusCode::INVALID_ARGUMENT; break;
    case ckpt::StatusCode::kNotFound: code = StatusCode::NOT_FOUND; break;
    case ckpt::StatusCode::kAlreadyExists: code = StatusCode::ALREADY_EXISTS; break;
    case ckpt::StatusCode::kFailedPrecondition: code = StatusCode::FAILED_PRECONDITION; break;
    case ckpt::StatusCode::kDataLoss: code = StatusCode::DATA_LOSS; break;
    case ckpt::StatusCode::kResourceExhausted: code = StatusCode::RESOURCE_EXHAUSTED; break;
    case ckpt::StatusCode::kPermissionDenied: code = StatusCode::PERMISSION_DENIED; break;
    case ckpt::StatusCode::kDeadlineExceeded: code = StatusCode::DEADLINE_EXCEEDED; break;
    case ckpt::StatusCode::kIoError: code = StatusCode::UNKNOWN; break;
    case ckpt::StatusCode::kInternal: code = StatusCode::INTERNAL; break;
  }
  return grpc::Status(code, s.message());
}

std::string NewSessionId() {
  static std::mutex mu;
  static std::random_device rd;
  static std::mt19937_64 gen(rd());
  std::lock_guard lock(mu);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen()));
  return buf;
}

// Whether the trainer behind a session has exited: its pidfd is readable, or, where no
// pidfd could be opened, its pid no longer exists.
bool TrainerExited(int pidfd, pid_t pid) {
  if (pidfd < 0) return pid <= 0 || (::kill(pid, 0) != 0 && errno == ESRCH);
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

}  // namespace

struct CheckpointService::Session {
  std::string id;
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  PeerCredentials peer;
  UniqueFd pidfd;
  std::shared_ptr<ImportedRegion> table;
  std::uint64_t table_generation = 0;
  std::vector<TableItem> items;
  std::vector<std::shared_ptr<ImportedRegion>> item_regions;  // parallel to items
  // What every snapshot starts from, prepared once per table generation.
  std::shared_ptr<const TensorSet> tensors;
  // Device regions: their device (-1 if none) and the session's interprocess events.
  int device = -1;
  std::unique_ptr<SessionEvents> events;
  std::unordered_set<std::string> item_names;
  std::uint64_t tensor_bytes = 0;

  std::mutex mu;  // serialises this session's calls that change its state (below)
  // The rank's current registration id (session id and a counter bumped by each restore),
  // written to the persistent tier and into every shard: see Catalog.
  std::string registration;
  std::uint64_t registrations = 0;
  std::uint64_t last_version = 0;
  std::map<std::uint64_t, std::shared_ptr<ShardJob>> shards;
  // Guarded by failures_mu, not mu: engine threads record failures here and must never
  // wait behind a long call (a Restore) holding mu.
  std::mutex failures_mu;
  std::set<std::uint64_t> unreported_failures;
  std::atomic<bool> open{true};
};

Result<std::unique_ptr<CheckpointService>> CheckpointService::Create(
    const Config& config, std::shared_ptr<Storage> storage, std::unique_ptr<RegionImporter> importer,
    const PeerRegistry* peers, std::shared_ptr<DeviceBackend> backend, std::string no_backend_reason) {
  std::unique_ptr<CheckpointService> svc(new CheckpointService(config));
  svc->storage_ = std::move(storage);
  svc->importer_ = std::move(importer);
  svc->backend_ = std::move(backend);
  svc->no_backend_reason_ = std::move(no_backend_reason);
  svc->peers_ = peers;
  svc->catalog_ = std::make_unique<Catalog>(svc->storage_, config.root, config.keep_last, config.keep_every);
  if (ckpt::Status s = svc->catalog_->Recover(); !s.ok()) return s.With("checkpoint root " + config.root);
  bool direct_ok = svc->storage_->SupportsDirectIo(config.root);
  switch (config.direct_io) {
    case DirectIoMode::kOn:
      if (!direct_ok) return FailedPrecondition(config.root + " does not accept O_DIRECT writes (--direct-io on)");
      svc->direct_io_ = true;
      break;
    case DirectIoMode::kOff: svc->direct_io_ = false; break;
    case DirectIoMode::kAuto: svc->direct_io_ = direct_ok; break;
  }
  if (!config.local_dir.empty()) {
    svc->local_root_ = config.local_dir;
    // Only *.tmp leftovers to remove: the local tier has no COMMITTED or latest of its own.
    Catalog local(svc->storage_, config.local_dir);
    if (ckpt::Status s = local.Recover(); !s.ok()) return s.With("local tier " + config.local_dir);
    bool local_direct = svc->storage_->SupportsDirectIo(config.local_dir);
    if (config.direct_io == DirectIoMode::kOn && !local_direct) {
      return FailedPrecondition(config.local_dir + " does not accept O_DIRECT writes (--direct-io on)");
    }
    svc->local_direct_io_ = config.direct_io != DirectIoMode::kOff && local_direct;
  }
  svc->memory_ = std::make_unique<MemoryTier>(config.memory_bytes(), config.memory_versions);
  auto pool = HostPool::Create(config.pool_bytes(), config.chunk_bytes());
  if (!pool.ok()) return pool.status();
  svc->pool_ = std::move(pool).value();
  if (svc->backend_) {
    // Device copies into pageable memory go through a staging buffer at a fraction of the
    // speed; the pool is page-locked once, here, never per checkpoint.
    if (ckpt::Status s = svc->backend_->Pin(svc->pool_->base(), svc->pool_->pool_bytes()); !s.ok()) {
      spdlog::warn("host pool not page-locked, device copies will be slower: {}", s.message());
    } else {
      std::shared_ptr<DeviceBackend> b = svc->backend_;
      void* base = svc->pool_->base();
      svc->pool_->OnDestroy([b, base] { b->Unpin(base); });
    }
  }
  CheckpointService* self = svc.get();
  svc->flush_ = std::make_unique<FlushEngine>(
      svc->storage_, *svc->pool_, config.writers,
      [self](const std::shared_ptr<ShardJob>& s) { self->OnDurable(s); },
      [self](const std::shared_ptr<ShardJob>& s) { self->OnFailed(s); }, svc->memory_.get());
  svc->copier_ = std::make_unique<ShardCopier>(svc->storage_, *svc->pool_, config.writers);
  svc->snapshot_ = std::make_unique<SnapshotEngine>(*svc->pool_, *svc->flush_, config.copiers,
                                                    svc->backend_.get(), config.copy_streams);
  svc->restore_ = std::make_unique<RestoreEngine>(svc->storage_, *svc->pool_, config.writers);
  if (ckpt::Status s = svc->ResumeLocalTier(); !s.ok()) return s.With("local tier " + config.local_dir);
  svc->reaper_ = std::thread([self] { self->ReapLoop(); });
  svc->watcher_ = std::thread([self] { self->CommitWatchLoop(); });
  svc->promoter_ = std::thread([self] { self->PromoteLoop(); });
  spdlog::info("root {} ({}), pool {} MiB in {} MiB chunks, {} writers, {} copiers", config.root,
               svc->direct_io_ ? "O_DIRECT" : "buffered writes + fdatasync", config.pool_mib,
               config.chunk_mib, config.writers, config.copiers);
  spdlog::info("tiers: memory {}, local {}, persistent {} (keep last {}{})",
               svc->memory_->enabled() ? std::to_string(config.memory_versions) + " version(s) in " +
                                             std::to_string(config.memory_mib) + " MiB"
                                       : std::string("off"),
               svc->local_root_.empty() ? std::string("none")
                                        : svc->local_root_ + (svc->local_direct_io_ ? " (O_DIRECT)" : " (buffered)") +
                                              ", keep last " + std::to_string(config.local_keep),
               config.root, config.keep_last == 0 ? std::string("all") : std::to_string(config.keep_last),
               config.keep_every ? ", and every " + std::to_string(config.keep_every) + "th" : std::string());
  if (svc->backend_) {
    spdlog::info("device backend: {}; {} copy streams per shard", svc->backend_->Describe(), config.copy_streams);
  } else {
    spdlog::info("no device backend ({}): GPU tensors are refused", svc->no_backend_reason_);
  }
  return svc;
}

CheckpointService::~CheckpointService() { Shutdown(); }

void CheckpointService::Shutdown() {
  {
    std::lock_guard lock(reap_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  reap_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  snapshot_->Stop();
  flush_->Stop();
  // The promoter finishes the promotions queued (a restart would resume them anyway), and
  // with them the commits they complete; then the watcher stops.
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  {
    std::lock_guard lock(promote_mu_);  // a waiting promoter sees stop_
  }
  promote_cv_.notify_all();
  if (promoter_.joinable()) promoter_.join();
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  pool_->Shutdown();
}

ckpt::Status CheckpointService::CheckPeer(grpc::ServerContext* ctx, PeerCredentials* peer) const {
  if (peers_ == nullptr) {  // in-process use (tests of the service alone)
    *peer = PeerCredentials{::getpid(), ::geteuid(), ::getegid()};
    return ckpt::Status::Ok();
  }
  auto creds = peers_->Lookup(ctx->peer());
  if (!creds) return PermissionDenied("cannot identify the peer " + ctx->peer());
  uid_t self = ::geteuid();
  if (creds->uid != self &&
      std::find(config_.allow_uids.begin(), config_.allow_uids.end(), creds->uid) == config_.allow_uids.end()) {
    return PermissionDenied("peer uid " + std::to_string(creds->uid) + " (pid " + std::to_string(creds->pid) +
                            ") is not allowed: this daemon serves uid " + std::to_string(self) +
                            " (add --allow-uid " + std::to_string(creds->uid) + " to serve it)");
  }
  *peer = *creds;
  return ckpt::Status::Ok();
}

ckpt::Status CheckpointService::FindSession(grpc::ServerContext* ctx, const std::string& id,
                                            std::shared_ptr<Session>* out) {
  PeerCredentials peer;
  if (ckpt::Status s = CheckPeer(ctx, &peer); !s.ok()) return s;
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || !it->second->open) {
    return NotFound("unknown or closed session '" + id.substr(0, 64) + "' (register first)");
  }
  if (it->second->peer.uid != peer.uid) {
    return PermissionDenied("session belongs to another uid");
  }
  *out = it->second;
  return ckpt::Status::Ok();
}

ckpt::Status CheckpointService::LoadTable(Session& s) {
  auto size = s.table->CurrentSize();
  if (!size.ok()) return size.status();
  auto read = [&](std::uint64_t off, void* dst, std::size_t len) { return s.table->ReadAt(off, dst, len); };
  std::uint64_t generation = 0;
  auto items = ReadDescriptorTable(read, size.value(), &generation);
  if (!items.ok()) return items.status();
  std::map<std::string, std::uint64_t> needed;  // region -> bytes its items need
  std::set<std::string> names;
  std::uint64_t total = 0;
  std::vector<ShardItem> shard_items;
  shard_items.reserve(items->size());
  for (const auto& it : items.value()) {
    if (std::string err = CheckItemName(it.name); !err.empty()) return InvalidArgument(err);
    if (!names.insert(it.name).second) return AlreadyExists("duplicate item name " + QuoteName(it.name));
    ShardItem item;
    item.name = it.name;
    item.kind = ItemKind::kTensor;
    item.dtype = it.dtype;
    item.shape = it.shape;
    item.length = it.length;
    if (ckpt::Status st = CheckItemShape(item); !st.ok()) return st;
    shard_items.push_back(std::move(item));
    if (it.offset > UINT64_MAX - it.length) {
      return InvalidArgument("item " + QuoteName(it.name) + ": offset + length overflows");
    }
    std::uint64_t& need = needed[it.region];
    need = std::max(need, it.offset + it.length);
    total += it.length;
  }
  std::map<std::string, std::shared_ptr<ImportedRegion>> fresh;
  for (const auto& [name, need] : needed) {
    // Opened afresh on every (re-)registration: the name may now refer to a new object.
    const bool device_region = backend_ && backend_->Owns(name);
    if (!device_region && name.starts_with("cuda:")) {
      return FailedPrecondition("region " + name.substr(0, 40) + "... is GPU memory, but this daemon has no CUDA backend (" +
                                no_backend_reason_ + ")");
    }
    auto imported = device_region ? backend_->Import(name, s.peer.pid, 0) : importer_->Import(name, s.peer.uid, 0);
    if (!imported.ok()) return imported.status();
    std::shared_ptr<ImportedRegion> region = std::move(imported).value();
    auto cur = region->CurrentSize();
    if (!cur.ok()) return cur.status();
    if (cur.value() < need) {
      for (const auto& it : items.value()) {
        if (it.region == name && it.offset + it.length > cur.value()) {
          return InvalidArgument("item " + QuoteName(it.name) + " needs bytes [" + std::to_string(it.offset) +
                                 ", " + std::to_string(it.offset + it.length) + ") of region " + name +
                                 ", which is only " + std::to_string(cur.value()) + " bytes");
        }
      }
    }
    fresh[name] = std::move(region);
  }
  int device = -1;
  for (const auto& [name, region] : fresh) {
    if (region->device() < 0) continue;
    if (device >= 0 && region->device() != device) {
      return InvalidArgument("tensors of one registration are on two GPUs (daemon devices " + std::to_string(device) +
                             " and " + std::to_string(region->device()) + "); register one rank's GPU only");
    }
    device = region->device();
  }
  if (s.events && device >= 0 && device != s.events->device()) {
    return FailedPrecondition("the tensors moved to another GPU than the session's; register again");
  }
  s.device = device;
  s.items = std::move(items).value();
  s.item_regions.clear();
  auto tensors = std::make_shared<TensorSet>();
  for (const auto& it : s.items) {
    s.item_regions.push_back(fresh.at(it.region));
    tensors->sources.push_back(ItemSource{s.item_regions.back(), it.offset, nullptr});
  }
  tensors->items = std::move(shard_items);
  tensors->bytes = total;
  s.tensors = std::move(tensors);
  s.item_names.clear();
  for (const auto& it : s.items) s.item_names.insert(it.name);
  s.tensor_bytes = total;
  s.table_generation = generation;
  return ckpt::Status::Ok();
}

ckpt::Status CheckpointService::AttachDevice(Session& s, const v1::RegisterRequest& req, v1::RegisterReply* reply) {
  if (s.device < 0) return ckpt::Status::Ok();
  if (!req.has_cuda() || req.cuda().trainer_events().empty()) {
    return InvalidArgument("GPU tensors need the registration's CUDA session (device UUID and trainer events)");
  }
  if (!s.events) {
    std::vector<std::string> handles(req.cuda().trainer_events().begin(), req.cuda().trainer_events().end());
    auto events = backend_->OpenSession(req.cuda().device_uuid(), handles);
    if (!events.ok()) return events.status().With("open the trainer's CUDA events");
    if (events.value()->device() != s.device) {
      return InvalidArgument("the registration names GPU " + req.cuda().device_uuid() +
                             " but its tensors are on another GPU");
    }
    s.events = std::move(events).value();
  }
  for (const auto& h : s.events->daemon_handles()) reply->add_daemon_events(h);
  return ckpt::Status::Ok();
}

grpc::Status CheckpointService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                         v1::RegisterReply* reply) {
  PeerCredentials peer;
  if (ckpt::Status s = CheckPeer(ctx, &peer); !s.ok()) return ToGrpc(s);
  if (std::string err = CheckJobId(req->job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  if (req->world_size() == 0 || req->world_size() > kMaxWorldSize) {
    return ToGrpc(InvalidArgument("world size " + std::to_string(req->world_size()) + " is not in [1, " +
                                  std::to_string(kMaxWorldSize) + "]"));
  }
  if (req->rank() >= req->world_size()) {
    return ToGrpc(InvalidArgument("rank " + std::to_string(req->rank()) + " is outside world size " +
                                  std::to_string(req->world_size())));
  }
  if (!req->session().empty()) {
    std::shared_ptr<Session> s;
    if (ckpt::Status st = FindSession(ctx, req->session(), &s); !st.ok()) return ToGrpc(st);
    if (s->job != req->job() || s->rank != req->rank() || s->world_size != req->world_size() ||
        s->table->name() != req->descriptor_table()) {
      return ToGrpc(InvalidArgument("re-registration must keep the session's job, rank, world size and table"));
    }
    std::lock_guard lock(s->mu);
    if (ckpt::Status st = LoadTable(*s); !st.ok()) return ToGrpc(st);
    if (ckpt::Status st = AttachDevice(*s, *req, reply); !st.ok()) return ToGrpc(st);
    reply->set_session(s->id);
    reply->set_item_count(static_cast<std::uint32_t>(s->items.size()));
    reply->set_tensor_bytes(s->tensor_bytes);
    reply->set_latest_committed(catalog_->Latest(s->job));
    return grpc::Status::OK;
  }
  auto session = std::make_shared<Session>();
  session->id = NewSessionId();
  session->job = req->job();
  session->rank = req->rank();
  session->world_size = req->world_size();
  session->peer = peer;
  session->pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, peer.pid, 0)));
  auto table = importer_->Import(req->descriptor_table(), peer.uid, sizeof(TableHeader));
  if (!table.ok()) return ToGrpc(table.status().With("descriptor table"));
  session->table = std::move(table).value();
  if (ckpt::Status s = LoadTable(*session); !s.ok()) return ToGrpc(s);
  if (ckpt::Status s = AttachDevice(*session, *req, reply); !s.ok()) return ToGrpc(s);
  {
    // The job directory exists (durably) before any shard is written into it.
    std::string job_dir = catalog_->JobDir(session->job);
    if (ckpt::Status s = storage_->MakeDirs(job_dir); !s.ok()) return ToGrpc(s);
    if (ckpt::Status s = storage_->SyncDir(config_.root); !s.ok()) return ToGrpc(s);
  }

  // A new registration of the rank makes its earlier shards stop counting towards commits
  // (see Catalog); the ones still in flight finish (and commit, if their version is
  // complete) first.
  if (ckpt::Status st = WaitForRankInFlight(ctx, session->job, session->rank); !st.ok()) return ToGrpc(st);
  std::shared_ptr<Session> replaced;
  {
    std::lock_guard lock(mu_);
    auto key = std::make_pair(session->job, session->rank);
    for (const auto& [id, other] : sessions_) {
      if (other->job == session->job && other->world_size != session->world_size &&
          !TrainerExited(other->pidfd.get(), other->peer.pid)) {
        return ToGrpc(InvalidArgument("job '" + session->job + "' runs with world size " +
                                      std::to_string(other->world_size) + " (rank " + std::to_string(other->rank) +
                                      "), not " + std::to_string(session->world_size)));
      }
    }
    if (auto it = rank_owner_.find(key); it != rank_owner_.end()) {
      auto old = sessions_.at(it->second);
      if (!TrainerExited(old->pidfd.get(), old->peer.pid)) {
        return ToGrpc(AlreadyExists("rank " + std::to_string(session->rank) + " of job '" + session->job +
                                    "' is already registered by pid " + std::to_string(old->peer.pid) +
                                    ", which is still running"));
      }
      replaced = old;
    }
    sessions_[session->id] = session;
    rank_owner_[key] = session->id;
  }
  {
    std::lock_guard slock(session->mu);
    if (ckpt::Status st = NewRegistration(*session); !st.ok()) {
      CloseSession(session, /*trainer_gone=*/false);
      return ToGrpc(st.With("record the registration of rank " + std::to_string(session->rank)));
    }
  }
  if (replaced) CloseSession(replaced, /*trainer_gone=*/true);
  reply->set_session(session->id);
  reply->set_item_count(static_cast<std::uint32_t>(session->items.size()));
  reply->set_tensor_bytes(session->tensor_bytes);
  reply->set_latest_committed(catalog_->Latest(session->job));
  spdlog::info("registered job {} rank {}/{} pid {}: {} items, {} bytes", session->job, session->rank,
               session->world_size, peer.pid, session->items.size(), session->tensor_bytes);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Snapshot(grpc::ServerContext* ctx, const v1::SnapshotRequest* req,
                                         v1::SnapshotReply* reply) {
  std::shared_ptr<Session> s;
  if (ckpt::Status st = FindSession(ctx, req->session(), &s); !st.ok()) return ToGrpc(st);
  std::lock_guard lock(s->mu);
  for (;;) {
    std::uint64_t v;
    {
      std::lock_guard flock(s->failures_mu);
      if (s->unreported_failures.empty()) break;
      v = *s->unreported_failures.begin();
      s->unreported_failures.erase(s->unreported_failures.begin());
    }
    auto it = s->shards.find(v);
    if (it == s->shards.end() || it->second->error_reported.exchange(true)) continue;
    ckpt::Status err = it->second->error();
    return ToGrpc(ckpt::Status(err.code(), "version " + std::to_string(v) + " failed: " + err.message() +
                                               " (reported now; this snapshot of version " +
                                               std::to_string(req->version()) + " was not taken)"));
  }
  const std::uint64_t v = req->version();
  if (v == 0 || v > kMaxVersion) {
    return ToGrpc(InvalidArgument("version " + std::to_string(v) + " is not in [1, " + std::to_string(kMaxVersion) + "]"));
  }
  for (;;) {
    std::shared_ptr<ShardJob> oldest;
    std::size_t in_flight = 0;
    for (const auto& [ver, shard] : s->shards) {
      if (shard->level() >= Level::kPersisted || shard->failed()) continue;
      if (!oldest) oldest = shard;
      ++in_flight;
    }
    if (in_flight < kMaxInFlightPerSession) break;
    oldest->WaitFor(Level::kPersisted, std::chrono::steady_clock::now() + std::chrono::milliseconds(500));
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  if (v <= s->last_version) {
    return ToGrpc(FailedPrecondition("version " + std::to_string(v) + " is not higher than " +
                                     std::to_string(s->last_version) +
                                     ", the last version this registration snapshotted or restored"));
  }
  std::uint64_t latest = catalog_->Latest(s->job);
  if (v <= latest) {
    return ToGrpc(FailedPrecondition("version " + std::to_string(v) + " is not higher than " +
                                     std::to_string(latest) + ", the newest committed version of job '" +
                                     s->job + "' (restore an older version first to roll back)"));
  }
  auto gen = ReadTableGeneration(
      [&](std::uint64_t off, void* dst, std::size_t len) { return s->table->ReadAt(off, dst, len); });
  if (!gen.ok()) return ToGrpc(gen.status());
  if (gen.value() != req->table_generation()) {
    return ToGrpc(FailedPrecondition("descriptor table is at generation " + std::to_string(gen.value()) +
                                     " but the client validated generation " +
                                     std::to_string(req->table_generation()) + "; register again"));
  }
  if (gen.value() != s->table_generation) {
    if (ckpt::Status st = LoadTable(*s); !st.ok()) return ToGrpc(st.With("re-reading descriptor table"));
    if (s->device >= 0 && !s->events) {
      return ToGrpc(FailedPrecondition("the descriptor table now lists GPU tensors; register again"));
    }
  }

  std::vector<ShardItem> items;  // the blobs; the tensors come from s->tensors
  std::vector<ItemSource> sources;
  std::unordered_set<std::string_view> blob_names;
  std::uint64_t blob_bytes = 0;
  for (const auto& b : req->blobs()) {
    if (std::string err = CheckItemName(b.name()); !err.empty()) return ToGrpc(InvalidArgument("blob: " + err));
    if (s->item_names.count(b.name()) || !blob_names.insert(b.name()).second) {
      return ToGrpc(AlreadyExists("blob name " + QuoteName(b.name()) + " is already used by another item"));
    }
    blob_bytes += b.data().size();
    ShardItem item;
    item.name = b.name();
    item.kind = ItemKind::kBlob;
    item.dtype = DType::kU8;
    item.shape = {static_cast<std::int64_t>(b.data().size())};
    item.length = b.data().size();
    items.push_back(std::move(item));
    sources.push_back(ItemSource{nullptr, 0, std::make_shared<const std::string>(b.data())});
  }
  if (blob_bytes > (config_.max_blob_mib << 20)) {
    return ToGrpc(ResourceExhausted("blobs total " + std::to_string(blob_bytes) + " bytes, over --max-blob-mib " +
                                    std::to_string(config_.max_blob_mib)));
  }
  std::shared_ptr<VersionSync> sync;
  if (s->events && s->device >= 0) {
    auto begun = s->events->Begin(v, req->trainer_event_slot());
    if (!begun.ok()) return ToGrpc(begun.status().With("version " + std::to_string(v)));
    sync = std::move(begun).value();
  }
  ShardMeta meta{s->job, v, s->rank, s->world_size, s->registration};
  const bool local = !local_root_.empty();
  auto shard = std::make_shared<ShardJob>(std::move(meta), s->tensors, std::move(items), std::move(sources),
                                          local ? LocalVersionDir(s->job, v) : catalog_->VersionDir(s->job, v),
                                          local ? local_direct_io_ : direct_io_);
  shard->publish_level = local ? Level::kLocal : Level::kPersisted;
  shard->device = s->device;
  shard->sync = std::move(sync);
  shard->copy_queue = s->id;
  reply->set_data_bytes(shard->data_bytes());
  s->last_version = v;
  s->shards[v] = shard;
  while (s->shards.size() > kVersionsKeptPerSession) {
    auto oldest = s->shards.begin();
    if (oldest->second->level() < Level::kPersisted && !oldest->second->failed()) break;
    s->shards.erase(oldest);
  }
  {
    std::lock_guard glock(mu_);
    // Versions that never commit leave entries whose shards are all gone: drop them.
    for (auto it = by_version_.begin(); it != by_version_.end();) {
      auto& weak = it->second;
      weak.erase(std::remove_if(weak.begin(), weak.end(), [](const auto& w) { return w.expired(); }), weak.end());
      it = weak.empty() ? by_version_.erase(it) : std::next(it);
    }
    by_version_[{s->job, v}].push_back(shard);
    recent_.push_back(shard);
    while (recent_.size() > kRecentShards) recent_.pop_front();
  }
  snapshot_->Enqueue(std::move(shard));
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Wait(grpc::ServerContext* ctx, const v1::WaitRequest* req, v1::WaitReply* reply) {
  std::shared_ptr<Session> s;
  if (ckpt::Status st = FindSession(ctx, req->session(), &s); !st.ok()) return ToGrpc(st);
  Level want;
  switch (req->level()) {
    case v1::LEVEL_CAPTURED: want = Level::kCaptured; break;
    case v1::LEVEL_LOCAL: want = Level::kLocal; break;
    case v1::LEVEL_DURABLE: want = Level::kPersisted; break;
    case v1::LEVEL_COMMITTED: want = Level::kCommitted; break;
    default: return ToGrpc(InvalidArgument("wait needs a level: captured, local, persisted (durable) or committed"));
  }
  std::shared_ptr<ShardJob> shard;
  {
    std::lock_guard lock(s->mu);
    auto it = s->shards.find(req->version());
    if (it == s->shards.end()) {
      return ToGrpc(NotFound("version " + std::to_string(req->version()) +
                             " was not snapshotted by this session (or is too old to wait for)"));
    }
    shard = it->second;
  }
  auto deadline = req->timeout_ms() == 0 || req->timeout_ms() > kMaxWaitMs
                      ? std::chrono::steady_clock::time_point::max()
                                         : std::chrono::steady_clock::now() + std::chrono::milliseconds(req->timeout_ms());
  if (req->stream_ordered() && want != Level::kCaptured) {
    return ToGrpc(InvalidArgument("a stream-ordered wait is for level captured only"));
  }
  // Stream-ordered waits of host-memory sessions are plain waits.
  const bool ordered = req->stream_ordered() && shard->sync != nullptr;
  ckpt::Status st;
  bool ordered_only = false;
  // Waits in slices so a client that goes away frees the thread.
  for (;;) {
    auto slice = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(500));
    st = ordered ? shard->WaitOrdered(slice, &ordered_only) : shard->WaitFor(want, slice);
    if (st.code() != ckpt::StatusCode::kDeadlineExceeded || slice == deadline) break;
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  if (!st.ok()) {
    if (shard->failed()) {
      shard->error_reported = true;
      st = st.With("version " + std::to_string(req->version()) + " failed");
    }
    return ToGrpc(st);
  }
  if (ordered_only) {
    reply->set_reached(v1::LEVEL_UNSPECIFIED);
    reply->set_has_daemon_event(true);
    reply->set_daemon_event_slot(shard->sync->daemon_slot());
    return grpc::Status::OK;
  }
  reply->set_reached(LevelToProto(shard->level()));
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                                        v1::RestoreReply* reply) {
  std::shared_ptr<Session> s;
  if (ckpt::Status st = FindSession(ctx, req->session(), &s); !st.ok()) return ToGrpc(st);
  std::lock_guard lock(s->mu);
  for (const auto& [v, shard] : s->shards) {
    if (shard->level() < Level::kCaptured && !shard->failed()) {
      return ToGrpc(FailedPrecondition("version " + std::to_string(v) +
                                       " is still being captured from this trainer's memory; "
                                       "wait for it before restoring"));
    }
  }
  // Versions of this rank still in flight (typically from a trainer that crashed right
  // after snapshot) finish first: the daemon holds their data, and the newest of them is
  // what the restarted trainer wants.
  if (ckpt::Status st = WaitForRankInFlight(ctx, s->job, s->rank); !st.ok()) return ToGrpc(st);
  std::uint64_t v = 0, latest = 0;
  std::unique_ptr<VersionHold> hold;
  if (ckpt::Status st = HoldCommitted(s->job, req->version(), &v, &latest, &hold); !st.ok()) return ToGrpc(st);
  // The fastest tier that holds the version: daemon memory, the local tier, the persistent
  // tier. Memory and local hold only what this daemon wrote or prefetched, and the version
  // is committed, so any copy of the shard is the committed one (checksums are verified).
  std::shared_ptr<MemoryImage> image = memory_->Find(s->job, v, s->rank);
  std::string path = catalog_->ShardPath(s->job, v, s->rank);
  std::string tier = "persistent";
  bool direct = direct_io_;
  if (image) {
    tier = "memory";
  } else if (!local_root_.empty()) {
    std::string local_path = LocalVersionDir(s->job, v) + "/" + ShardFileName(s->rank);
    if (storage_->Exists(local_path)) {
      path = local_path;
      tier = "local";
      direct = local_direct_io_;
    }
  }
  const ShardMeta* meta = nullptr;
  Result<ShardInfo> info = ShardInfo{};
  if (image) {
    meta = &image->meta;
  } else {
    info = ReadShardHeader(path);
    if (!info.ok()) return ToGrpc(info.status());
    meta = &info->meta;
  }
  if (meta->world_size != s->world_size || meta->rank != s->rank || meta->job != s->job) {
    return ToGrpc(FailedPrecondition("shard " + path + " was written by rank " + std::to_string(meta->rank) +
                                     " of " + std::to_string(meta->world_size) + " (job '" + meta->job +
                                     "'), not rank " + std::to_string(s->rank) + " of " +
                                     std::to_string(s->world_size)));
  }
  std::vector<RestoreTarget> targets;
  for (std::size_t i = 0; i < s->items.size(); ++i) {
    const TableItem& t = s->items[i];
    RestoreTarget target;
    target.item.name = t.name;
    target.item.dtype = t.dtype;
    target.item.shape = t.shape;
    target.item.length = t.length;
    target.region = s->item_regions[i];
    target.region_offset = t.offset;
    targets.push_back(std::move(target));
  }
  auto restored = image ? restore_->RestoreFromImage(*image, targets) : restore_->Restore(path, targets, direct);
  if (!restored.ok()) return ToGrpc(restored.status().With("restore version " + std::to_string(v) + " from " + tier));
  bytes_read_total_ += restored->bytes_read;
  (tier == "memory" ? restored_memory_ : tier == "local" ? restored_local_ : restored_persistent_) +=
      restored->tensor_bytes;
  if (v < latest) {
    auto moved = catalog_->SetAsideNewerThan(s->job, v);
    if (!moved.ok()) return ToGrpc(moved.status().With("set aside versions newer than " + std::to_string(v)));
    spdlog::info("job {}: rolled back to version {}, {} newer version(s) set aside", s->job, v, moved.value());
    memory_->DropNewerThan(s->job, s->rank, v);
  }
  if (v < latest) {
    // Numbering continues from v: versions above it will be committed (again).
    std::lock_guard glock(mu_);
    auto& done = finished_commits_[s->job];
    done = std::min(done, v);
  }
  // What this rank published before belongs to the timeline it just left.
  if (ckpt::Status st = NewRegistration(*s); !st.ok()) return ToGrpc(st.With("after restoring version " + std::to_string(v)));
  s->last_version = v;
  reply->set_version(v);
  reply->set_tensor_bytes(restored->tensor_bytes);
  reply->set_tier(tier);
  for (auto& [name, data] : restored->blobs) {
    auto* b = reply->add_blobs();
    b->set_name(name);
    b->set_data(std::move(data));
  }
  spdlog::info("job {} rank {}: restored version {} from {} ({} bytes, {} read from disk)", s->job, s->rank, v, tier,
               restored->tensor_bytes, restored->bytes_read);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::List(grpc::ServerContext* ctx, const v1::ListRequest* req, v1::ListReply* reply) {
  PeerCredentials peer;
  if (ckpt::Status st = CheckPeer(ctx, &peer); !st.ok()) return ToGrpc(st);
  if (std::string err = CheckJobId(req->job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  auto versions = catalog_->List(req->job());
  if (!versions.ok()) return ToGrpc(versions.status());
  std::map<std::uint64_t, v1::VersionInfo> out;
  for (const auto& e : versions.value()) {
    auto& v = out[e.version];
    v.set_version(e.version);
    v.set_committed(e.committed);
    for (auto r : e.ranks) v.add_durable_ranks(r);
  }
  if (!local_root_.empty()) {
    const std::string dir = local_root_ + "/" + req->job();
    if (auto names = storage_->List(dir); names.ok()) {
      for (const auto& n : names.value()) {
        auto ver = ParseVersionDirName(n);
        if (!ver) continue;
        auto files = storage_->List(dir + "/" + n);
        if (!files.ok()) continue;
        std::vector<std::uint32_t> ranks;
        for (const auto& f : files.value()) {
          if (auto r = ParseShardFileName(f)) ranks.push_back(*r);
        }
        std::sort(ranks.begin(), ranks.end());
        auto& v = out[*ver];
        v.set_version(*ver);
        if (!v.committed()) v.set_committed(catalog_->IsCommitted(req->job(), *ver));
        for (auto r : ranks) v.add_local_ranks(r);
      }
    }
  }
  for (const auto& [ver, ranks] : memory_->List(req->job())) {
    auto& v = out[ver];
    v.set_version(ver);
    if (!v.committed()) v.set_committed(catalog_->IsCommitted(req->job(), ver));
    for (auto r : ranks) v.add_memory_ranks(r);
  }
  for (auto& [ver, info] : out) *reply->add_versions() = std::move(info);
  reply->set_latest(catalog_->RefreshLatest(req->job()));
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*, v1::StatusReply* reply) {
  PeerCredentials peer;
  if (ckpt::Status st = CheckPeer(ctx, &peer); !st.ok()) return ToGrpc(st);
  reply->set_daemon_version(CKPTD_VERSION);
  reply->set_pid(::getpid());
  reply->set_uptime_s(static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - started_).count()));
  reply->set_root(config_.root);
  reply->set_direct_io(direct_io_);
  reply->set_pool_bytes(pool_->pool_bytes());
  reply->set_pool_used_bytes(pool_->used_bytes());
  reply->set_chunk_bytes(pool_->chunk_bytes());
  reply->set_device_backend(backend_ ? backend_->Describe() : "none (" + no_backend_reason_ + ")");
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<std::shared_ptr<ShardJob>> shards;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, sess] : sessions_) sessions.push_back(sess);
    shards.assign(recent_.begin(), recent_.end());
    for (const auto& e : errors_) reply->add_errors(e);
  }
  for (const auto& sess : sessions) {
    auto* c = reply->add_clients();
    c->set_session(sess->id);
    c->set_job(sess->job);
    c->set_rank(sess->rank);
    c->set_world_size(sess->world_size);
    c->set_pid(sess->peer.pid);
    c->set_alive(!TrainerExited(sess->pidfd.get(), sess->peer.pid));
    std::unique_lock lock(sess->mu, std::try_to_lock);  // never block status on a busy session
    if (lock.owns_lock()) {
      c->set_items(static_cast<std::uint32_t>(sess->items.size()));
      c->set_tensor_bytes(sess->tensor_bytes);
      c->set_last_version(sess->last_version);
    }
  }
  std::uint64_t copied = copied_done_total_, written = written_done_total_;
  for (const auto& shard : shards) {
    auto* sh = reply->add_shards();
    sh->set_job(shard->meta().job);
    sh->set_rank(shard->meta().rank);
    sh->set_version(shard->meta().version);
    sh->set_total_bytes(shard->data_bytes());
    sh->set_copied_bytes(shard->copied_bytes.load());
    sh->set_written_bytes(shard->written_bytes.load());
    sh->set_level(LevelToProto(shard->level()));
    if (shard->failed()) sh->set_error(shard->error().message());
    sh->set_capture_ms(shard->MillisTo(Level::kCaptured));
    sh->set_durable_ms(shard->MillisTo(Level::kPersisted));
    Level l = shard->level();
    if (l < Level::kPersisted && !shard->failed()) {
      copied += shard->copied_bytes.load();
      written += shard->written_bytes.load();
    }
  }
  reply->set_bytes_copied_total(copied);
  reply->set_bytes_written_total(written);
  reply->set_bytes_read_total(bytes_read_total_);
  reply->set_versions_committed(committed_total_);
  reply->set_restored_bytes_memory(restored_memory_);
  reply->set_restored_bytes_local(restored_local_);
  reply->set_restored_bytes_persistent(restored_persistent_);
  {
    auto st = memory_->GetStats();
    auto* t = reply->add_tiers();
    t->set_name("memory");
    t->set_shards(st.images);
    t->set_bytes(st.bytes);
    t->set_budget_bytes(st.budget);
    t->set_retention(memory_->enabled() ? "newest " + std::to_string(config_.memory_versions) +
                                              " committed version(s) per rank, within the budget"
                                        : std::string("off"));
  }
  if (!local_root_.empty()) {
    auto* t = reply->add_tiers();
    t->set_name("local");
    t->set_dir(local_root_);
    t->set_retention("last " + std::to_string(config_.local_keep) + " committed versions");
  }
  {
    auto* t = reply->add_tiers();
    t->set_name("persistent");
    t->set_dir(config_.root);
    t->set_retention(config_.keep_last == 0
                         ? std::string("every version")
                         : "last " + std::to_string(config_.keep_last) + " committed versions" +
                               (config_.keep_every ? ", and every " + std::to_string(config_.keep_every) + "th"
                                                   : std::string()));
  }
  {
    std::lock_guard lock(promote_mu_);
    reply->set_promotions_pending(static_cast<std::uint32_t>(promotions_.size() + (promoting_ ? 1 : 0)));
  }
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Unregister(grpc::ServerContext* ctx, const v1::UnregisterRequest* req,
                                           v1::UnregisterReply*) {
  std::shared_ptr<Session> s;
  if (ckpt::Status st = FindSession(ctx, req->session(), &s); !st.ok()) return ToGrpc(st);
  CloseSession(s, /*trainer_gone=*/false);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                                         v1::PrefetchReply* reply) {
  PeerCredentials peer;
  if (ckpt::Status st = CheckPeer(ctx, &peer); !st.ok()) return ToGrpc(st);
  if (std::string err = CheckJobId(req->job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  if (local_root_.empty() && !memory_->enabled()) {
    return ToGrpc(FailedPrecondition("this daemon has neither a local tier (--local) nor a memory tier "
                                     "(--memory-mib): nothing to prefetch into"));
  }
  std::uint64_t v = 0, latest = 0;
  std::unique_ptr<VersionHold> hold;
  if (ckpt::Status st = HoldCommitted(req->job(), req->version(), &v, &latest, &hold); !st.ok()) return ToGrpc(st);
  std::vector<std::uint32_t> ranks(req->ranks().begin(), req->ranks().end());
  if (ranks.empty()) {
    auto listed = storage_->List(catalog_->VersionDir(req->job(), v));
    if (!listed.ok()) return ToGrpc(listed.status());
    for (const auto& f : listed.value()) {
      if (auto r = ParseShardFileName(f)) ranks.push_back(*r);
    }
    std::sort(ranks.begin(), ranks.end());
  }
  std::uint64_t bytes = 0;
  std::uint32_t local_shards = 0, memory_shards = 0;
  for (std::uint32_t rank : ranks) {
    const std::string src = catalog_->ShardPath(req->job(), v, rank);
    auto info = ReadShardHeader(src);
    if (!info.ok()) return ToGrpc(info.status().With("prefetch rank " + std::to_string(rank)));
    std::string read_from = src;
    bool read_direct = direct_io_;
    if (!local_root_.empty()) {
      std::string local_path = LocalVersionDir(req->job(), v) + "/" + ShardFileName(rank);
      if (!storage_->Exists(local_path)) {
        ShardCopier::Source from{src, direct_io_, nullptr, info->file_bytes};
        ShardCopier::Target to{LocalVersionDir(req->job(), v), ShardFileName(rank), local_direct_io_, v};
        auto copied = copier_->Copy(from, to);
        if (!copied.ok()) return ToGrpc(copied.status().With("prefetch rank " + std::to_string(rank) + " to local"));
        bytes += copied.value();
        ++local_shards;
      }
      read_from = local_path;
      read_direct = local_direct_io_;
    }
    if (memory_->enabled() && !memory_->Find(req->job(), v, rank)) {
      auto image = memory_->Reserve(info->meta, info->file_bytes);
      if (image) {
        auto fd = storage_->OpenForRead(read_from, read_direct);
        if (!fd.ok()) return ToGrpc(fd.status());
        const std::uint64_t len = read_direct ? image->capacity() : image->file_bytes;
        std::uint64_t got_total = 0;
        while (got_total < image->file_bytes) {
          std::uint64_t n = std::min<std::uint64_t>(len - got_total, pool_->chunk_bytes());
          auto got = storage_->ReadAt(fd->get(), image->data() + got_total, n, got_total, read_from);
          if (!got.ok()) {
            memory_->Drop(image);
            return ToGrpc(got.status());
          }
          if (got.value() == 0) break;
          got_total += got.value();
        }
        if (got_total < image->file_bytes) {
          memory_->Drop(image);
          return ToGrpc(DataLoss(read_from + " ended early (truncated shard)"));
        }
        if (local_root_.empty()) bytes += image->file_bytes;
        memory_->Complete(image);
        ++memory_shards;
      }
    }
  }
  memory_->OnCommitted(req->job(), v);
  bytes_read_total_ += bytes;
  reply->set_version(v);
  reply->set_local_shards(local_shards);
  reply->set_memory_shards(memory_shards);
  reply->set_bytes(bytes);
  spdlog::info("job {}: prefetched version {} ({} rank(s): {} to local, {} to memory, {} bytes read)", req->job(), v,
               ranks.size(), local_shards, memory_shards, bytes);
  return grpc::Status::OK;
}

void CheckpointService::CloseSession(const std::shared_ptr<Session>& s, bool trainer_gone) {
  if (!s->open.exchange(false)) return;
  {
    std::lock_guard lock(mu_);
    sessions_.erase(s->id);
    auto key = std::make_pair(s->job, s->rank);
    if (auto it = rank_owner_.find(key); it != rank_owner_.end() && it->second == s->id) rank_owner_.erase(it);
  }
  if (trainer_gone) {
    // The trainer cannot clean up its shared memory any more; in-flight copies keep
    // their descriptors, so removing the names loses nothing.
    for (const auto& r : s->item_regions) r->UnlinkIfOrphaned();
    s->table->UnlinkIfOrphaned();
    if (s->device >= 0) {
      // Its GPU versions not yet captured are given up: their copies wait on events of a
      // context that is gone (which may never fire), and an event that fires at teardown
      // would not mean the update was complete.
      std::vector<std::shared_ptr<ShardJob>> uncaptured;
      {
        std::lock_guard lock(mu_);
        for (const auto& [key, shards] : by_version_) {
          if (key.first != s->job) continue;
          for (const auto& weak : shards) {
            auto shard = weak.lock();
            if (shard && shard->copy_queue == s->id && shard->level() < Level::kCaptured) {
              uncaptured.push_back(std::move(shard));
            }
          }
        }
      }
      for (const auto& shard : uncaptured) {
        shard->Fail(FailedPrecondition("trainer pid " + std::to_string(s->peer.pid) + " exited before version " +
                                       std::to_string(shard->meta().version) +
                                       " was copied out of its GPU memory; the version is abandoned"));
      }
    }
    // Its CUDA allocations are closed now, or when the copies still using them end.
    if (backend_) backend_->ReleaseClient(s->peer.pid);
    spdlog::info("job {} rank {}: trainer pid {} exited; session closed", s->job, s->rank, s->peer.pid);
  } else {
    spdlog::info("job {} rank {}: unregistered", s->job, s->rank);
  }
}

void CheckpointService::OnDurable(const std::shared_ptr<ShardJob>& shard) {
  copied_done_total_ += shard->copied_bytes.load();
  written_done_total_ += shard->written_bytes.load();
  if (shard->image) {
    memory_->Complete(shard->image);
    // The tier owns it now: a shard kept for status must not pin its buffer.
    shard->image.reset();
  }
  const ShardMeta& m = shard->meta();
  if (shard->publish_level == Level::kLocal) {
    PromoteTask task{m, shard->final_path(), shard->layout().file_bytes(), shard};
    PinLocal(m.job, m.version);  // until promoted
    {
      std::lock_guard lock(promote_mu_);
      promotions_.push_back(std::move(task));
    }
    promote_cv_.notify_one();
    return;
  }
  OnPersisted(m, shard);
}

bool CheckpointService::OnPersisted(const ShardMeta& m, const std::shared_ptr<ShardJob>& shard) {
  if (shard) shard->persisted = true;  // before the marker: a commit may follow at once
  if (ckpt::Status st = catalog_->WriteDoneMarker(m.job, m.version, m.rank, m.session); !st.ok()) {
    st = st.With("done marker of rank " + std::to_string(m.rank));
    if (shard) {
      shard->Fail(st);  // the flush engine or the promoter reports it
    } else {
      RecordError("job " + m.job + " version " + std::to_string(m.version) + ": " + st.message());
    }
    return false;
  }
  bool decides = false;
  {
    std::lock_guard lock(mu_);
    auto key = std::make_pair(m.job, m.version);
    if (m.rank == 0) pending_commits_[key] = m.world_size;
    decides = pending_commits_.count(key) != 0;
    if (!decides) watched_commits_[key] = m.world_size;
  }
  // Synchronous where this daemon decides: a waiter woken by `persisted` sees the decision.
  if (decides) TryCommit(m.job, m.version, m.world_size, shard);
  watch_cv_.notify_all();
  return true;
}

void CheckpointService::TryCommit(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                  const std::shared_ptr<ShardJob>& shard) {
  bool committed = false;
  ckpt::Status st = catalog_->CommitIfComplete(job, version, world_size, &committed);
  if (committed) {
    FinishCommit(job, version, shard, /*ours=*/true);
    return;
  }
  std::vector<std::shared_ptr<ShardJob>> peers;
  {
    std::lock_guard lock(mu_);
    const bool superseded = st.ok() && version < catalog_->Latest(job);
    if (st.ok() && !superseded) return;  // not complete yet: the watcher looks again
    pending_commits_.erase({job, version});
    if (st.ok()) return;  // a newer version committed first; this one never will
    peers = TakeShardsLocked(job, version);
  }
  RecordError("job " + job + " version " + std::to_string(version) + ": commit failed: " + st.message());
  // Every rank of the version hears of the failed commit, as of any flush failure.
  for (const auto& p : peers) {
    p->Fail(st.With("commit"));
    OnFailed(p);
  }
}

void CheckpointService::FinishCommit(const std::string& job, std::uint64_t version,
                                     const std::shared_ptr<ShardJob>& shard, bool ours) {
  std::vector<std::shared_ptr<ShardJob>> peers;
  {
    std::lock_guard lock(mu_);
    // The watcher and a writer may both see the commit: the first one finishes it.
    auto& done = finished_commits_[job];
    if (version <= done) return;
    done = version;
    peers = TakeShardsLocked(job, version);
    // Older versions that never completed will not commit: this one is newer.
    for (auto* m : {&pending_commits_, &watched_commits_}) {
      for (auto i = m->begin(); i != m->end();) {
        i = i->first.first == job && i->first.second <= version ? m->erase(i) : std::next(i);
      }
    }
  }
  if (ours) {
    ++committed_total_;
    spdlog::info("job {}: version {} committed", job, version);
  } else {
    spdlog::debug("job {}: version {} committed by rank 0's daemon", job, version);
  }
  // The tiers' retention first, so that a trainer woken by the commit finds them settled.
  memory_->OnCommitted(job, version);
  ApplyLocalRetention(job);
  // Only shards that are persisted are part of the commit (each sets `persisted` before
  // its marker, so none is missed); one whose writer has not raised it to persisted yet
  // goes straight to committed, which implies persisted.
  for (const auto& p : peers) {
    if (p == shard || p->persisted) p->Reach(Level::kCommitted);
  }
}

void CheckpointService::CommitWatchLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    bool busy = !pending_commits_.empty() || !watched_commits_.empty();
    // Polls the shared directory while some commit is awaited; idle otherwise.
    watch_cv_.wait_for(lock, busy ? std::chrono::milliseconds(20) : std::chrono::milliseconds(500));
    if (stop_) break;
    auto pending = pending_commits_;
    auto watched = watched_commits_;
    lock.unlock();
    for (const auto& [key, world] : pending) TryCommit(key.first, key.second, world, nullptr);
    for (const auto& [key, world] : watched) {
      if (catalog_->IsCommitted(key.first, key.second)) {
        catalog_->NoteCommitted(key.first, key.second);
        FinishCommit(key.first, key.second, nullptr, /*ours=*/false);
      } else if (key.second < catalog_->Latest(key.first)) {
        std::lock_guard l(mu_);
        watched_commits_.erase(key);  // a newer version committed first
      }
    }
    lock.lock();
  }
}

void CheckpointService::PromoteLoop() {
  for (;;) {
    PromoteTask task;
    {
      std::unique_lock lock(promote_mu_);
      promoting_ = false;
      promote_cv_.wait(lock, [&] { return stop_ || !promotions_.empty(); });
      if (promotions_.empty()) return;  // stopping, and nothing left
      task = std::move(promotions_.front());
      promotions_.pop_front();
      promoting_ = true;
    }
    const ShardMeta& m = task.meta;
    ShardCopier::Source src;
    src.path = task.local_path;
    src.direct_io = local_direct_io_;
    src.file_bytes = task.file_bytes;
    // From the memory tier's image if it still has one (no read); queued tasks hold none,
    // so the tier's budget is spent on what it keeps.
    src.image = memory_->Find(m.job, m.version, m.rank);
    if (src.image && src.image->meta.session != m.session) src.image = nullptr;
    ShardCopier::Target dst{catalog_->VersionDir(m.job, m.version), ShardFileName(m.rank), direct_io_, m.version};
    auto copied = copier_->Copy(src, dst);
    bool ok = copied.ok();
    if (!ok) {
      ckpt::Status st = copied.status().With("promote to the persistent tier");
      if (task.shard) {
        task.shard->Fail(st);
        OnFailed(task.shard);
      } else {
        RecordError("job " + m.job + " rank " + std::to_string(m.rank) + " version " + std::to_string(m.version) +
                    ": " + st.message());
      }
    } else {
      ok = OnPersisted(m, task.shard);
      if (!ok && task.shard) OnFailed(task.shard);
      if (ok && task.shard) task.shard->Reach(Level::kPersisted);
      if (ok && !task.shard) spdlog::info("job {} rank {} version {}: promotion resumed and done", m.job, m.rank, m.version);
    }
    UnpinLocal(m.job, m.version);
  }
}

std::vector<std::shared_ptr<ShardJob>> CheckpointService::TakeShardsLocked(const std::string& job,
                                                                          std::uint64_t version) {
  std::vector<std::shared_ptr<ShardJob>> out;
  auto it = by_version_.find({job, version});
  if (it == by_version_.end()) return out;
  for (const auto& w : it->second) {
    if (auto p = w.lock()) out.push_back(std::move(p));
  }
  by_version_.erase(it);
  return out;
}

void CheckpointService::PinLocal(const std::string& job, std::uint64_t version) {
  std::lock_guard lock(promote_mu_);
  local_pins_.insert({job, version});
}

void CheckpointService::UnpinLocal(const std::string& job, std::uint64_t version) {
  std::lock_guard lock(promote_mu_);
  local_pins_.erase(local_pins_.find({job, version}));
}

// Keeps a version from every retention (persistent and local) while it is read.
struct CheckpointService::VersionHold {
  CheckpointService& self;
  std::string job;
  std::uint64_t version;
  VersionHold(CheckpointService& s, std::string j, std::uint64_t v) : self(s), job(std::move(j)), version(v) {
    self.catalog_->Pin(job, version);
    self.PinLocal(job, version);
  }
  ~VersionHold() {
    self.UnpinLocal(job, version);
    self.catalog_->Unpin(job, version);
  }
};

ckpt::Status CheckpointService::HoldCommitted(const std::string& job, std::uint64_t requested, std::uint64_t* v,
                                              std::uint64_t* latest, std::unique_ptr<VersionHold>* hold) {
  // Another node's daemon may have committed since this one last looked.
  *latest = catalog_->RefreshLatest(job);
  *v = requested == 0 ? *latest : requested;
  if (*v == 0) return NotFound("job '" + job + "' has no committed version under " + config_.root);
  *hold = std::make_unique<VersionHold>(*this, job, *v);  // before the check: retention waits
  if (!catalog_->IsCommitted(job, *v)) {
    return NotFound("version " + std::to_string(*v) + " of job '" + job + "' is not committed" +
                    (*latest ? " (newest committed: " + std::to_string(*latest) + ")" : std::string()));
  }
  return ckpt::Status::Ok();
}

std::string CheckpointService::LocalVersionDir(const std::string& job, std::uint64_t version) const {
  return local_root_ + "/" + job + "/" + VersionDirName(version);
}

ckpt::Status CheckpointService::ResumeLocalTier() {
  if (local_root_.empty()) return ckpt::Status::Ok();
  auto jobs = storage_->List(local_root_);
  if (!jobs.ok()) return jobs.status();
  int resumed = 0, watched = 0;
  for (const auto& job : jobs.value()) {
    if (!CheckJobId(job).empty()) continue;
    auto versions = storage_->List(local_root_ + "/" + job);
    if (!versions.ok()) continue;
    std::uint64_t latest = catalog_->RefreshLatest(job);
    for (const auto& name : versions.value()) {
      auto v = ParseVersionDirName(name);
      if (!v || *v <= latest) continue;  // committed, or never will be: retention's
      auto files = storage_->List(local_root_ + "/" + job + "/" + name);
      if (!files.ok()) continue;
      for (const auto& f : files.value()) {
        auto rank = ParseShardFileName(f);
        if (!rank) continue;
        std::string path = local_root_ + "/" + job + "/" + name + "/" + f;
        auto info = ReadShardHeader(path);
        if (!info.ok() || info->meta.job != job || info->meta.version != *v || info->meta.rank != *rank) {
          spdlog::warn("local tier: {} is not a valid shard ({}); removed", path,
                       info.ok() ? "its metadata names another place" : info.status().message());
          storage_->Remove(path);
          continue;
        }
        const ShardMeta& m = info->meta;
        if (catalog_->HasDoneMarker(job, *v, *rank, m.session)) {
          // Promoted before the restart: only the commit is left to see.
          std::lock_guard lock(mu_);
          auto key = std::make_pair(job, *v);
          if (*rank == 0) pending_commits_[key] = m.world_size;
          if (!pending_commits_.count(key)) watched_commits_[key] = m.world_size;
          ++watched;
          continue;
        }
        PinLocal(job, *v);
        std::lock_guard lock(promote_mu_);
        promotions_.push_back(PromoteTask{m, path, info->file_bytes, nullptr});
        ++resumed;
      }
    }
    ApplyLocalRetention(job);
  }
  if (resumed + watched > 0) {
    spdlog::info("local tier: {} promotion(s) resumed, {} commit(s) awaited after the restart", resumed, watched);
  }
  return ckpt::Status::Ok();
}

void CheckpointService::ApplyLocalRetention(const std::string& job) {
  if (local_root_.empty()) return;
  std::lock_guard retention(local_retention_mu_);
  const std::string dir = local_root_ + "/" + job;
  auto names = storage_->List(dir);
  if (!names.ok()) return;
  std::vector<std::uint64_t> versions;
  for (const auto& n : names.value()) {
    if (auto v = ParseVersionDirName(n)) versions.push_back(*v);
  }
  std::sort(versions.rbegin(), versions.rend());  // newest first
  std::uint32_t kept = 0;
  bool seen_committed = false;
  for (std::uint64_t v : versions) {
    bool drop = false;
    if (catalog_->IsCommitted(job, v)) {
      seen_committed = true;
      drop = ++kept > config_.local_keep;
    } else {
      drop = seen_committed;  // older than a committed version: it never commits
    }
    if (!drop) continue;
    {
      std::lock_guard lock(promote_mu_);
      if (local_pins_.count({job, v}) != 0) continue;  // promoting or restoring; later
    }
    const std::string vdir = dir + "/" + VersionDirName(v);
    if (auto files = storage_->List(vdir); files.ok()) {
      for (const auto& f : files.value()) storage_->Remove(vdir + "/" + f);
    }
    if (ckpt::Status st = storage_->Remove(vdir); !st.ok()) {
      spdlog::warn("local tier: cannot remove {}: {}", vdir, st.message());
    }
  }
}

ckpt::Status CheckpointService::NewRegistration(Session& s) {
  std::string id = s.id + "." + std::to_string(++s.registrations);
  if (ckpt::Status st = catalog_->WriteRankRegistration(s.job, s.rank, id); !st.ok()) return st;
  s.registration = std::move(id);
  return ckpt::Status::Ok();
}

void CheckpointService::OnFailed(const std::shared_ptr<ShardJob>& shard) {
  const ShardMeta& m = shard->meta();
  memory_->Drop(shard->image);
  shard->image.reset();
  RecordError("job " + m.job + " rank " + std::to_string(m.rank) + " version " + std::to_string(m.version) +
              ": " + shard->error().message());
  std::shared_ptr<Session> owner;
  {
    std::lock_guard lock(mu_);
    auto it = rank_owner_.find({m.job, m.rank});
    if (it != rank_owner_.end()) owner = sessions_.at(it->second);
  }
  if (owner) {
    std::lock_guard lock(owner->failures_mu);
    owner->unreported_failures.insert(m.version);
  }
}

ckpt::Status CheckpointService::WaitForRankInFlight(grpc::ServerContext* ctx, const std::string& job,
                                                    std::uint32_t rank) {
  std::vector<std::shared_ptr<ShardJob>> inflight;
  {
    std::lock_guard lock(mu_);
    for (const auto& shard : recent_) {
      if (shard->meta().job == job && shard->meta().rank == rank) inflight.push_back(shard);
    }
  }
  for (const auto& shard : inflight) {
    for (;;) {
      auto slice = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
      ckpt::Status st = shard->WaitFor(Level::kPersisted, slice);
      if (st.code() != ckpt::StatusCode::kDeadlineExceeded) break;
      if (ctx->IsCancelled()) return ckpt::Status(ckpt::StatusCode::kDeadlineExceeded, "client went away");
    }
  }
  return ckpt::Status::Ok();
}

void CheckpointService::RecordError(const std::string& message) {
  spdlog::error("{}", message);
  std::lock_guard lock(mu_);
  errors_.push_back(message);
  while (errors_.size() > kRecentErrors) errors_.pop_front();
}

void CheckpointService::ReapLoop() {
  std::unique_lock lock(reap_mu_);
  while (!stopping_) {
    reap_cv_.wait_for(lock, std::chrono::milliseconds(250));
    std::vector<std::shared_ptr<Session>> gone;
    {
      std::lock_guard glock(mu_);
      for (const auto& [id, s] : sessions_) {
        if (TrainerExited(s->pidfd.get(), s->peer.pid)) gone.push_back(s);
      }
    }
    for (const auto& s : gone) CloseSession(s, /*trainer_gone=*/true);
    snapshot_->ReclaimAbandoned();
  }
}

}  // namespace ckpt
