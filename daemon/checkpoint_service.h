// CheckpointService: the gRPC face of the daemon, and the owner of the pipeline.
//
// Each call is validated (peer uid, session, names, bounds, versions) and turned into work
// for the stages: Register imports the trainer's regions and reads its descriptor table;
// Snapshot plans a shard and queues it on the SnapshotEngine (copy), which feeds the
// FlushEngine (write), whose durable shards go to the Catalog (commit); Restore runs the
// RestoreEngine. With a local tier, published shards are promoted to the persistent tier by
// a ShardCopier; the memory tier keeps the newest versions whole. Errors become gRPC statuses whose message says what is wrong; nothing a
// client sends can stop the daemon serving the others. Thread-safe (gRPC calls it from
// many threads).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "daemon/commit/catalog.h"
#include "daemon/config.h"
#include "backend/device_copier.h"
#include "daemon/pipeline/flush_engine.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/rpc/peer_registry.h"
#include "backend/region_importer.h"
#include "daemon/tiers/memory_tier.h"
#include "daemon/pipeline/restore_engine.h"
#include "daemon/pipeline/shard_copier.h"
#include "daemon/pipeline/snapshot_engine.h"
#include "daemon/io/storage.h"
#include "shm/descriptor_table.h"

namespace ckpt {

class CheckpointService final : public v1::Checkpoint::Service {
 public:
  // Builds the pipeline. `storage` and `importer` are injectable for tests. `backend` (may
  // be null) imports and copies device regions; without one, `no_backend_reason` says why
  // in the error a GPU registration gets.
  static Result<std::unique_ptr<CheckpointService>> Create(const Config& config,
                                                           std::shared_ptr<Storage> storage,
                                                           std::unique_ptr<RegionImporter> importer,
                                                           const PeerRegistry* peers,
                                                           std::shared_ptr<DeviceBackend> backend = nullptr,
                                                           std::string no_backend_reason = "");
  ~CheckpointService() override;

  // Stops taking work, lets in-flight shards finish, stops the threads.
  void Shutdown();

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterReply*) override;
  grpc::Status Snapshot(grpc::ServerContext*, const v1::SnapshotRequest*, v1::SnapshotReply*) override;
  grpc::Status Wait(grpc::ServerContext*, const v1::WaitRequest*, v1::WaitReply*) override;
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest*, v1::RestoreReply*) override;
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*, v1::ListReply*) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusReply*) override;
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterReply*) override;
  grpc::Status Prefetch(grpc::ServerContext*, const v1::PrefetchRequest*, v1::PrefetchReply*) override;

 private:
  struct Session;

  explicit CheckpointService(const Config& config) : config_(config) {}

  ckpt::Status CheckPeer(grpc::ServerContext* ctx, PeerCredentials* peer) const;
  ckpt::Status FindSession(grpc::ServerContext* ctx, const std::string& id, std::shared_ptr<Session>* out);
  ckpt::Status LoadTable(Session& s);
  // Opens (or checks) the session's device events after LoadTable found device regions.
  ckpt::Status AttachDevice(Session& s, const v1::RegisterRequest& req, v1::RegisterReply* reply);
  void CloseSession(const std::shared_ptr<Session>& s, bool trainer_gone);
  // A shard is published on its first tier (local, or persistent when there is none).
  void OnDurable(const std::shared_ptr<ShardJob>& shard);
  void OnFailed(const std::shared_ptr<ShardJob>& shard);
  // A shard is durable on the persistent tier: writes its done marker, then commits the
  // version if this daemon serves its rank 0 (else watches for the commit). `shard` may be
  // null (a promotion resumed after a restart). False if the marker could not be written.
  bool OnPersisted(const ShardMeta& meta, const std::shared_ptr<ShardJob>& shard);
  // Commits (job, version) if complete (this daemon serves its rank 0).
  void TryCommit(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                 const std::shared_ptr<ShardJob>& shard);
  // (job, version) is committed (by this daemon if `ours`): raises this daemon's shards of
  // it, stops watching it and older versions, applies the retention of memory and local.
  void FinishCommit(const std::string& job, std::uint64_t version, const std::shared_ptr<ShardJob>& shard,
                    bool ours);
  // Polls the persistent tier for versions whose commit depends on other daemons.
  void CommitWatchLoop();
  // Promotes shards from the local tier to the persistent tier, in order.
  void PromoteLoop();
  // At start: queues promotions cut off by a restart, watches their versions' commits.
  ckpt::Status ResumeLocalTier();
  // Deletes what the local tier's retention rule no longer keeps for `job`.
  void ApplyLocalRetention(const std::string& job);
  std::string LocalVersionDir(const std::string& job, std::uint64_t version) const;
  // The committed version `requested` (0: the newest) of `job`, held against retention on
  // every tier until *hold goes; NotFound saying why if there is none.
  struct VersionHold;
  ckpt::Status HoldCommitted(const std::string& job, std::uint64_t requested, std::uint64_t* v,
                             std::uint64_t* latest, std::unique_ptr<VersionHold>* hold);
  // Local retention skips pinned versions (queued promotions, restores, prefetches).
  void PinLocal(const std::string& job, std::uint64_t version);
  void UnpinLocal(const std::string& job, std::uint64_t version);
  // Removes and returns this daemon's live shards of (job, version); caller holds mu_.
  std::vector<std::shared_ptr<ShardJob>> TakeShardsLocked(const std::string& job, std::uint64_t version);
  // Writes a new registration id for the session's rank (caller holds s.mu).
  ckpt::Status NewRegistration(Session& s);
  void RecordError(const std::string& message);
  // Blocks until no shard of (job, rank) is in flight (each durable or failed); CANCELLED
  // if the caller goes away meanwhile.
  ckpt::Status WaitForRankInFlight(grpc::ServerContext* ctx, const std::string& job, std::uint32_t rank);
  void ReapLoop();

  Config config_;
  bool direct_io_ = false;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::shared_ptr<Storage> storage_;
  std::unique_ptr<RegionImporter> importer_;
  std::shared_ptr<DeviceBackend> backend_;
  std::string no_backend_reason_;
  const PeerRegistry* peers_ = nullptr;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<Catalog> catalog_;
  std::unique_ptr<FlushEngine> flush_;
  std::unique_ptr<SnapshotEngine> snapshot_;
  std::unique_ptr<RestoreEngine> restore_;

  std::mutex mu_;  // guards the maps below
  std::map<std::string, std::shared_ptr<Session>> sessions_;                 // by id
  std::map<std::pair<std::string, std::uint32_t>, std::string> rank_owner_;  // (job, rank) -> id
  // Tiers besides the persistent one (catalog_): memory (may be disabled) and local
  // (local_root_ empty: none).
  std::unique_ptr<MemoryTier> memory_;
  std::string local_root_;
  bool local_direct_io_ = false;
  std::unique_ptr<ShardCopier> copier_;
  struct PromoteTask {
    ShardMeta meta;
    std::string local_path;
    std::uint64_t file_bytes = 0;
    std::shared_ptr<ShardJob> shard;  // null for a promotion resumed after a restart
  };
  std::mutex promote_mu_;
  std::condition_variable promote_cv_;
  std::deque<PromoteTask> promotions_;
  bool promoting_ = false;  // a task is being copied
  std::thread promoter_;
  // Versions of the local tier retention must not delete: promotions queued, restores.
  std::multiset<std::pair<std::string, std::uint64_t>> local_pins_;  // guarded by promote_mu_
  std::mutex local_retention_mu_;  // one local retention pass at a time
  // Commits this daemon decides (it persisted rank 0's shard) and commits it waits to
  // see (another daemon decides): (job, version) -> world size. Guarded by mu_.
  std::map<std::pair<std::string, std::uint64_t>, std::uint32_t> pending_commits_;
  std::map<std::pair<std::string, std::uint64_t>, std::uint32_t> watched_commits_;
  std::map<std::string, std::uint64_t> finished_commits_;  // job -> newest commit finished here
  std::condition_variable watch_cv_;  // with mu_
  std::thread watcher_;
  std::atomic<std::uint64_t> restored_memory_{0}, restored_local_{0}, restored_persistent_{0};

  // Shards of each (job, version) in this daemon, so a commit can raise all of them.
  std::map<std::pair<std::string, std::uint64_t>, std::vector<std::weak_ptr<ShardJob>>> by_version_;
  std::deque<std::shared_ptr<ShardJob>> recent_;  // for Status: in flight and recently done
  std::deque<std::string> errors_;

  std::atomic<std::uint64_t> bytes_read_total_{0};
  std::atomic<std::uint64_t> committed_total_{0};
  std::atomic<std::uint64_t> copied_done_total_{0};
  std::atomic<std::uint64_t> written_done_total_{0};

  std::atomic<bool> stop_{false};  // the watcher and the promoter stop
  std::mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace ckpt
