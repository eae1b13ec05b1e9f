// Daemon: the parts of ckptd, built in the order of the pipeline and shut down in reverse.
//
//   import (TableLoader, SessionTable) -> admit (SnapshotAdmission) -> copy (SnapshotEngine,
//   HostPool) -> write (FlushEngine) -> promote (Promoter: local -> persistent tier)
//   -> commit (CommitTracker, Catalog) ; restore (Restorer, TierSet, RestoreEngine)
//
// The daemon owns every part and wires their hooks: a shard published on its first tier is
// promoted (local tier) or handed to the commit tracker (persistent tier); a failed shard
// drops its memory image, is recorded, and its trainer hears of it on its next call; a
// committed version lets the memory and local tiers apply their retention. The RPC layer
// (daemon/rpc/) reaches the parts through the accessors below. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "backend/device_copier.h"
#include "backend/region_importer.h"
#include "common/mutex.h"
#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "daemon/commit/commit_tracker.h"
#include "daemon/commit/replica_claims.h"
#include "daemon/replication/warm_start.h"
#include "daemon/base/config.h"
#include "daemon/base/error_log.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/flush_engine.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/pipeline/restore_engine.h"
#include "daemon/pipeline/shard_copier.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/pipeline/snapshot_engine.h"
#include "daemon/replication/erasure_group.h"
#include "daemon/replication/replicator.h"
#include "daemon/session/admission.h"
#include "daemon/session/job_owners.h"
#include "daemon/session/registrar.h"
#include "daemon/session/restorer.h"
#include "daemon/session/session_table.h"
#include "daemon/session/table_loader.h"
#include "daemon/session/uid_limits.h"
#include "daemon/tiers/local_tier.h"
#include "daemon/tiers/memory_tier.h"
#include "daemon/pipeline/promoter.h"
#include "daemon/pipeline/tier_set.h"

namespace ckpt {

class Daemon {
 public:
  // Builds and starts every part. `storage` and `importer` are injectable for tests.
  // `backend` (may be null) imports and copies device regions; without one,
  // `no_backend_reason` says why in the error a GPU registration gets.
  static Result<std::unique_ptr<Daemon>> Create(const Config& config, std::shared_ptr<Storage> storage,
                                                std::unique_ptr<RegionImporter> importer,
                                                std::shared_ptr<DeviceBackend> backend = nullptr,
                                                std::string no_backend_reason = "");
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Stops taking work, lets in-flight shards finish (and the promotions queued), stops the
  // threads. Idempotent.
  void Shutdown() EXCLUDES(shutdown_mu_);

  const Config& config() const { return config_; }
  std::chrono::steady_clock::time_point started() const { return started_; }
  // "CUDA ...: 1 device (...)", or "none (why)".
  std::string DescribeBackend() const;

  SessionTable& sessions() { return *sessions_; }
  Registrar& registrar() { return *registrar_; }
  SnapshotAdmission& admission() { return *admission_; }
  Restorer& restorer() { return *restorer_; }
  JobOwners& owners() { return *owners_; }
  TierSet& tiers() { return *tiers_; }
  MemoryTier& memory() { return *memory_; }
  Catalog& catalog() { return *catalog_; }
  ShardRegistry& shards() { return shards_; }
  const HostPool& pool() const { return *pool_; }
  const Promoter* promoter() const { return promoter_.get(); }
  const CommitTracker& commits() const { return *commits_; }
  const ErrorLog& errors() const { return errors_; }
  // Versions this daemon saw commit since it started (it wrote a shard of each), whichever
  // daemon decided the commit: what status and ckptd_versions_committed_total both count, so
  // every node of a job reports the same number for it.
  std::uint64_t versions_committed() const { return versions_committed_; }
  RestoreCounters& restore_counters() { return restore_counters_; }
  // Peer replication; null with --replicas 0.
  Replicator* replicator() { return replicator_.get(); }
  ErasureGroup* erasure() { return erasure_.get(); }
  // Warm starts from peers (daemon/replication/warm_start.h); null with --replicas 0.
  WarmStart* warm_start() { return warm_start_.get(); }

  // Seals a shard of a sealed registration (ShardJob::Seal), or aborts it (ShardJob::Abort,
  // `why` with code ABORTED), and has it finished if it was waiting, written, for that.
  Status SealShard(const std::shared_ptr<ShardJob>& shard);
  Status AbortShard(const std::shared_ptr<ShardJob>& shard, const Status& why);

  // Bytes copied and written by shards that finished (those still in flight count apart).
  std::uint64_t copied_done_total() const { return copied_done_total_; }
  std::uint64_t written_done_total() const { return written_done_total_; }

 private:
  explicit Daemon(const Config& config) : config_(config) {}
  Status Build(std::shared_ptr<Storage> storage, std::unique_ptr<RegionImporter> importer,
               std::shared_ptr<DeviceBackend> backend, std::string no_backend_reason);
  void PinPool();
  void LogTiers() const;
  // Queues promotions a restart cut off and awaits the commits of shards promoted before it.
  Status ResumeLocalTier();

  // Hooks of the stages.
  void OnPublished(const std::shared_ptr<ShardJob>& shard);  // on its first tier
  void OnFailed(const std::shared_ptr<ShardJob>& shard);
  void OnCommitted(const std::string& job, std::uint64_t version);

  const Config config_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::shared_ptr<Storage> storage_;
  std::unique_ptr<RegionImporter> importer_;
  std::shared_ptr<DeviceBackend> backend_;
  std::string no_backend_reason_;
  bool persistent_direct_io_ = false;

  ErrorLog errors_;
  RestoreCounters restore_counters_;
  std::atomic<std::uint64_t> copied_done_total_{0};
  std::atomic<std::uint64_t> written_done_total_{0};
  std::atomic<std::uint64_t> versions_committed_{0};

  // In stage order; destroyed in reverse.
  std::unique_ptr<Catalog> catalog_;
  std::unique_ptr<LocalTier> local_;
  std::unique_ptr<MemoryTier> memory_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<ReplicaClaims> replica_claims_;  // with replicator_
  std::unique_ptr<ErasureGroup> erasure_;   // null without --erasure
  std::unique_ptr<Replicator> replicator_;  // null with --replicas 0
  std::unique_ptr<WarmStart> warm_start_;   // with replicator_
  ShardRegistry shards_;
  std::unique_ptr<ShardCopier> copier_;
  std::unique_ptr<TierSet> tiers_;
  std::unique_ptr<CommitTracker> commits_;
  std::unique_ptr<BaseChooser> bases_;  // with promoter_
  std::unique_ptr<Promoter> promoter_;  // null without a local tier
  std::unique_ptr<FlushEngine> flush_;
  std::unique_ptr<SnapshotEngine> snapshot_;
  std::unique_ptr<RestoreEngine> restore_;
  std::unique_ptr<JobOwners> owners_;
  std::unique_ptr<ItemBudget> items_;
  std::unique_ptr<TableLoader> loader_;
  std::unique_ptr<SessionTable> sessions_;
  std::unique_ptr<Registrar> registrar_;
  std::unique_ptr<SnapshotAdmission> admission_;
  std::unique_ptr<Restorer> restorer_;

  Mutex shutdown_mu_;
  bool shut_down_ GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace ckpt
