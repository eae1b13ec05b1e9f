#include "daemon/daemon.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>

#include "daemon/metrics/daemon_metrics.h"

namespace ckpt {

Result<std::unique_ptr<Daemon>> Daemon::Create(const Config& config, std::shared_ptr<Storage> storage,
                                               std::unique_ptr<RegionImporter> importer,
                                               std::shared_ptr<DeviceBackend> backend,
                                               std::string no_backend_reason) {
  std::unique_ptr<Daemon> d(new Daemon(config));
  if (Status st =
          d->Build(std::move(storage), std::move(importer), std::move(backend), std::move(no_backend_reason));
      !st.ok()) {
    return st;  // the destructor stops whatever was started
  }
  return d;
}

namespace {

// The local tier's retention deletes whole version directories, COMMITTED included: were it
// the persistent tier under another name (a link in a path that did not exist yet when the
// flags were parsed, a bind mount) or inside it, or the other way round, it would delete
// committed checkpoints. So the two are compared once both exist, by device and inode, and
// by their resolved paths for nesting.
Status CheckTiersApart(Storage& storage, const std::string& root, const std::string& local) {
  if (Status s = storage.MakeDirs(local); !s.ok()) return s.With("local tier " + local);
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path r = fs::canonical(root, ec);
  if (ec) return IoError("resolve " + root, ec.value());
  const fs::path l = fs::canonical(local, ec);
  if (ec) return IoError("resolve " + local, ec.value());
  const bool same = fs::equivalent(r, l, ec);
  auto inside = [](const fs::path& outer, const fs::path& inner) {
    auto [o, i] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
    return o == outer.end();
  };
  if (same || inside(r, l) || inside(l, r)) {
    return FailedPrecondition("--local " + local + " (" + l.string() + ") and --root " + root + " (" +
                              r.string() +
                              ") are the same directory or one holds the other; the local tier's retention "
                              "would delete committed versions: give two separate directories");
  }
  return Status::Ok();
}

}  // namespace

Status Daemon::Build(std::shared_ptr<Storage> storage, std::unique_ptr<RegionImporter> importer,
                     std::shared_ptr<DeviceBackend> backend, std::string no_backend_reason) {
  storage_ = std::move(storage);
  importer_ = std::move(importer);
  backend_ = std::move(backend);
  no_backend_reason_ = std::move(no_backend_reason);

  // The persistent tier: its tree, its leftovers, whether it takes O_DIRECT.
  catalog_ = std::make_unique<Catalog>(storage_, config_.root, config_.keep_last, config_.keep_every,
                                       [this](const std::string& m) {
                                         metrics::Metrics().Error(metrics::ErrorKind::kCatalog);
                                         errors_.Record(m);
                                       });
  catalog_->EnableVersionIndex();
  if (Status s = catalog_->Recover(); !s.ok()) return s.With("checkpoint root " + config_.root);
  const bool direct_ok = storage_->SupportsDirectIo(config_.root);
  if (config_.direct_io == DirectIoMode::kOn && !direct_ok) {
    return FailedPrecondition(config_.root + " does not accept O_DIRECT writes (--direct-io on)");
  }
  persistent_direct_io_ = config_.direct_io != DirectIoMode::kOff && direct_ok;
  if (!config_.local_dir.empty()) {
    if (Status s = CheckTiersApart(*storage_, config_.root, config_.local_dir); !s.ok()) return s;
    auto local =
        LocalTier::Open(storage_, config_.local_dir, config_.direct_io, config_.local_keep, *catalog_);
    if (!local.ok()) return local.status().With("local tier " + config_.local_dir);
    local_ = std::move(local).value();
  }
  // Images of ranks with no live session give way when a running job needs the room.
  memory_ = std::make_unique<MemoryTier>(config_.memory_bytes(), config_.memory_versions,
                                         [this](const std::string& job, std::uint32_t rank) {
                                           if (!sessions_) return true;
                                           for (const auto& s : sessions_->All()) {
                                             if (s->job == job && s->rank == rank && !s->TrainerExited())
                                               return true;
                                           }
                                           return false;
                                         });

  // The data path: pool, copier between tiers, commit, promotion, writers, copiers.
  auto pool = HostPool::Create(config_.pool_bytes(), config_.chunk_bytes(), config_.pool_numa);
  if (!pool.ok()) return pool.status();
  pool_ = std::move(pool).value();
  PinPool();
  copier_ = std::make_unique<ShardCopier>(storage_, *pool_, config_.writers);
  tiers_ = std::make_unique<TierSet>(storage_, *catalog_, persistent_direct_io_, local_.get(), *memory_,
                                     *copier_, pool_->chunk_bytes());
  if (config_.erasure_k > 0) {
    // Shards are protected by parity on the group's daemons; without replicas, the group
    // serves --peer-listen itself.
    auto erasure = ErasureGroup::Create(config_, *memory_, config_.replicas == 0,
                                        [this](const std::string& m) { errors_.Record(m); });
    if (!erasure.ok()) return erasure.status();
    erasure_ = std::move(erasure).value();
    tiers_->SetPeers(erasure_.get());
  }
  if (config_.replicas > 0) {
    // Shards go to peers' memory, and restores read peers' memory.
    const HostPool* pool = pool_.get();
    replica_claims_ = std::make_unique<ReplicaClaims>(*catalog_, [this](const std::string& m) { errors_.Record(m); });
    auto replicator = Replicator::Create(
        config_, *memory_,
        Replicator::Hooks{[this](const std::string& m) { errors_.Record(m); }, [pool] { return pool->used_bytes(); },
                          pool_->pool_bytes(),
                          [claims = replica_claims_.get()](const ShardMeta& m) { claims->Submit(m); }},
        erasure_ ? erasure_->store() : nullptr);
    if (!replicator.ok()) return replicator.status();
    replicator_ = std::move(replicator).value();
    replicator_->SetErasure(erasure_.get());
    tiers_->SetPeers(replicator_.get());
    warm_start_ = std::make_unique<WarmStart>(*replicator_, *tiers_, config_.warm_start_mib_per_s << 20,
                                              [this](const std::string& m) { errors_.Record(m); });
  }
  commits_ = std::make_unique<CommitTracker>(
      *catalog_, shards_,
      CommitTracker::Hooks{[this](const std::string& job, std::uint64_t v) { OnCommitted(job, v); },
                           [this](const std::shared_ptr<ShardJob>& s) { OnFailed(s); },
                           [this](const std::string& m) {
                             metrics::Metrics().Error(metrics::ErrorKind::kCommit);
                             errors_.Record(m);
                           },
                           [this](const std::string& job, const std::string& reason, const std::string& m) {
                             metrics::Metrics().UnderReplicated(job, reason);
                             // Superseded: a newer version is committed (and what a lost
                             // node restores): nothing for the operator to act on.
                             if (reason != "superseded") errors_.Record(m);
                           }},
      CommitTracker::ReplicaWait{config_.replicas > 0 && config_.replica_commit_timeout_s > 0,
                                 config_.replicas, std::chrono::seconds(config_.replica_commit_timeout_s)});
  if (local_) {
    bases_ = std::make_unique<BaseChooser>(storage_, *catalog_, config_.persistent_base_every);
    promoter_ = std::make_unique<Promoter>(
        *local_, *memory_, *copier_, *catalog_, persistent_direct_io_,
        Promoter::Hooks{[this](const ShardMeta& m, const std::shared_ptr<ShardJob>& s) {
                          return commits_->OnPersisted(m, s);
                        },
                        [this](const std::shared_ptr<ShardJob>& s) { OnFailed(s); },
                        [this](const std::string& m) {
                          metrics::Metrics().Error(metrics::ErrorKind::kPromote);
                          errors_.Record(m);
                        },
                        [this](const std::shared_ptr<ShardJob>& s) {
                          // Skipped by the queue's policy: its waits hear why, but it is no
                          // failure of the run (the trainer's next snapshot goes on).
                          if (!s->ClaimFailureHandling()) return;
                          s->ClaimErrorReport();
                          if (s->ReleaseLocalPin()) local_->Unpin(s->meta().job, s->meta().version);
                        }},
        bases_.get());
  }
  flush_ = std::make_unique<FlushEngine>(
      storage_, *pool_, config_.writers, [this](const std::shared_ptr<ShardJob>& s) { OnPublished(s); },
      [this](const std::shared_ptr<ShardJob>& s) { OnFailed(s); }, memory_.get());
  snapshot_ = std::make_unique<SnapshotEngine>(*pool_, *flush_, config_.copiers, backend_.get(),
                                               config_.copy_streams);
  restore_ = std::make_unique<RestoreEngine>(storage_, *pool_, config_.writers, backend_.get(),
                                             config_.copy_streams, RestoreLimits{config_.max_blob_mib << 20});

  // The sessions: import, admission, restore.
  owners_ = std::make_unique<JobOwners>(storage_, config_.root, config_.job_group);
  items_ = std::make_unique<ItemBudget>(config_.max_items_per_uid);
  loader_ = std::make_unique<TableLoader>(*importer_, backend_.get(), no_backend_reason_, *items_);
  sessions_ = std::make_unique<SessionTable>(
      shards_, backend_.get(), [this] { snapshot_->ReclaimAbandoned(); }, config_.max_sessions_per_uid,
      *items_);
  sessions_->SetAborter([this](const std::shared_ptr<ShardJob>& s, const Status& why) { (void)AbortShard(s, why); });
  registrar_ = std::make_unique<Registrar>(*catalog_, *owners_, *loader_, *sessions_, shards_,
                                           config_.max_registrations_per_uid, *items_, promoter_.get(),
                                           config_.restart_waits_newest);
  admission_ = std::make_unique<SnapshotAdmission>(*catalog_, persistent_direct_io_, local_.get(), *loader_,
                                                   shards_, *snapshot_, config_.max_blob_mib << 20);
  restorer_ = std::make_unique<Restorer>(*tiers_, *restore_, shards_, *commits_, *registrar_,
                                         restore_counters_, errors_, config_.restart_waits_newest);

  if (Status st = ResumeLocalTier(); !st.ok()) return st.With("local tier " + config_.local_dir);
  commits_->Start();
  if (promoter_) promoter_->Start();
  sessions_->StartReaper();
  // Before the trainers register: a replacement node's ranks then restore from memory.
  if (warm_start_ && config_.warm_start) warm_start_->StartAll();
  spdlog::info("root {} ({}), pool {} MiB in {} MiB chunks (NUMA {}: {}), {} writers, {} copiers",
               config_.root, persistent_direct_io_ ? "O_DIRECT" : "buffered writes + fdatasync",
               config_.pool_mib, config_.chunk_mib, config_.pool_numa.Name(), pool_->numa_nodes(),
               config_.writers, config_.copiers);
  LogTiers();
  if (backend_) {
    spdlog::info("device backend: {}; {} copy streams per shard", backend_->Describe(), config_.copy_streams);
  } else {
    spdlog::info("no device backend ({}): GPU tensors are refused", no_backend_reason_);
  }
  return Status::Ok();
}

void Daemon::PinPool() {
  if (!backend_) return;
  // Device copies into pageable memory go through a staging buffer at a fraction of the
  // speed; the pool is page-locked once, here, never per checkpoint.
  if (Status s = backend_->Pin(pool_->base(), pool_->pool_bytes(), pool_->numa_node()); !s.ok()) {
    spdlog::warn("host pool not page-locked, device copies will be slower: {}", s.message());
    return;
  }
  std::shared_ptr<DeviceBackend> b = backend_;
  void* base = pool_->base();
  pool_->OnDestroy([b, base] { b->Unpin(base); });
}

void Daemon::LogTiers() const {
  const std::string memory = memory_->enabled()
                                 ? std::to_string(config_.memory_versions) + " version(s) in " +
                                       std::to_string(config_.memory_mib) + " MiB"
                                 : std::string("off");
  const std::string local = !local_ ? std::string("none")
                                    : local_->root() + (local_->direct_io() ? " (O_DIRECT)" : " (buffered)") +
                                          ", keep last " + std::to_string(config_.local_keep);
  spdlog::info(
      "tiers: memory {}, local {}, persistent {} (keep last {}{})", memory, local, config_.root,
      config_.keep_last == 0 ? std::string("all") : std::to_string(config_.keep_last),
      config_.keep_every ? ", and every " + std::to_string(config_.keep_every) + "th" : std::string());
}

Status Daemon::ResumeLocalTier() {
  if (!local_) return Status::Ok();
  auto found = local_->ScanUncommitted();
  if (!found.ok()) return found.status();
  int resumed = 0, awaited = 0;
  for (auto& shard : found.value()) {
    const ShardMeta& m = shard.meta;
    if (catalog_->HasDoneMarker(m.job, m.version, m.rank, m.session)) {
      commits_->Await(m);  // promoted before the restart: only the commit is left to see
      ++awaited;
      continue;
    }
    promoter_->Enqueue(Promoter::Task{m, std::move(shard.path), shard.file_bytes, nullptr});
    ++resumed;
  }
  local_->ApplyRetentionToAll();  // after the resumed promotions are queued (pinned)
  if (resumed + awaited > 0) {
    spdlog::info("local tier: {} promotion(s) resumed, {} commit(s) awaited after the restart", resumed,
                 awaited);
  }
  return Status::Ok();
}

Daemon::~Daemon() { Shutdown(); }

void Daemon::Shutdown() {
  {
    MutexLock lock(shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  // Reverse stage order: no more reaping, copies end, writes end, the queued promotions
  // finish (a restart would resume them anyway) with the commits they complete, then the
  // commit watcher stops. A part that Build did not reach is null.
  if (sessions_) sessions_->Stop();
  if (warm_start_) warm_start_->Stop();  // its pulls read through the replicator
  if (replicator_) replicator_->Stop();
  if (erasure_) erasure_->Stop();
  // Shards that finish during the stop are not replicated any more: their versions commit on
  // persistence (under-replicated, said so) rather than wait for claims that never come.
  if (commits_) commits_->ReplicationStopped();
  // The replicator (stopped above) hands it claims; its thread writes on the catalog and
  // reports to the error log: stopped before any of them goes.
  if (replica_claims_) replica_claims_->Stop();
  if (snapshot_) snapshot_->Stop();
  if (flush_) flush_->Stop();
  if (promoter_) promoter_->Stop();
  if (commits_) commits_->Stop();
  if (pool_) pool_->Shutdown();
}

std::string Daemon::DescribeBackend() const {
  return backend_ ? backend_->Describe() : "none (" + no_backend_reason_ + ")";
}

void Daemon::OnPublished(const std::shared_ptr<ShardJob>& shard) {
  copied_done_total_ += shard->copied_bytes.load();
  written_done_total_ += shard->written_bytes.load();
  if (replicator_) {
    if (shard->image) {
      replicator_->Enqueue(shard->image);
    } else {
      replicator_->NotReplicable(shard->meta(),
                                 "the memory tier did not keep it (--memory-mib too small for it: see the log)");
    }
  }
  if (erasure_ && shard->image) erasure_->Enqueue(shard->image);
  if (shard->image) {
    memory_->Complete(shard->image);
    // The tier owns it now: a shard kept for status must not pin its buffer.
    shard->image.reset();
  }
  const ShardMeta& m = shard->meta();
  if (shard->publish_level() == Level::kLocal) {
    promoter_->Enqueue(Promoter::Task{m, shard->final_path(), shard->layout().file_bytes(), shard});
    if (shard->ReleaseLocalPin()) local_->Unpin(m.job, m.version);  // the promoter's pin holds it now
    return;
  }
  commits_->OnPersisted(m, shard);
}

void Daemon::OnFailed(const std::shared_ptr<ShardJob>& shard) {
  if (!shard->ClaimFailureHandling()) return;
  const ShardMeta& m = shard->meta();
  if (local_ && shard->ReleaseLocalPin()) local_->Unpin(m.job, m.version);
  memory_->Drop(shard->image);
  shard->image.reset();
  if (replicator_) replicator_->NotReplicable(m, shard->error().message());
  if (shard->skipped()) {
    // Nothing failed either: a newer version, or the version the job went on from, made this
    // one unneeded. Status shows it as skipped, with the reason; no error is counted.
    shard->ClaimErrorReport();
    return;
  }
  if (shard->aborted()) {
    // Nothing failed: the version is given up on purpose, and says so where readers look.
    metrics::Metrics().ShardAborted(m.job);
    errors_.Record("job " + m.job + " rank " + std::to_string(m.rank) + " version " + std::to_string(m.version) +
                   " aborted: " + shard->error().message());
    sessions_->NoteFailure(m.job, m.rank, m.version);
    return;
  }
  const Level reached = shard->level();
  metrics::Metrics().Error(
      shard->publish_level() == Level::kLocal && reached >= Level::kLocal ? metrics::ErrorKind::kPromote
      : shard->writing_failed() || reached >= Level::kCaptured            ? metrics::ErrorKind::kWrite
                                                                          : metrics::ErrorKind::kCopy);
  metrics::Metrics().VersionFailed(m.job, m.version);
  errors_.Record("job " + m.job + " rank " + std::to_string(m.rank) + " version " +
                 std::to_string(m.version) + ": " + shard->error().message());
  sessions_->NoteFailure(m.job, m.rank, m.version);
}

Status Daemon::SealShard(const std::shared_ptr<ShardJob>& shard) {
  bool finish = false;
  Status st = shard->Seal(&finish);
  if (finish) flush_->Resume(shard);
  return st;
}

Status Daemon::AbortShard(const std::shared_ptr<ShardJob>& shard, const Status& why) {
  bool finish = false;
  Status st = shard->Abort(why, &finish);
  if (st.ok()) {
    const ShardMeta& m = shard->meta();
    spdlog::warn("job {} rank {} version {} aborted: {}", m.job, m.rank, m.version, why.message());
    // Before the caller hears of it: whoever lists the version next sees why it never commits.
    if (Status w = catalog_->WriteAborted(m.job, m.version, m.rank, why.message()); !w.ok()) {
      spdlog::warn("job {} version {}: could not record its abort: {}", m.job, m.version, w.message());
    }
  }
  if (finish) flush_->Resume(shard);
  return st;
}

void Daemon::OnCommitted(const std::string& job, std::uint64_t version) {
  ++versions_committed_;
  metrics::Metrics().Committed(job);
  if (replicator_) replicator_->OnCommitted(job, version);
  if (erasure_) erasure_->OnCommitted(job, version);
  memory_->OnCommitted(job, version);
  if (local_) local_->ApplyRetention(job);
}

}  // namespace ckpt
