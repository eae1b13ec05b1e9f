// CheckpointService: the gRPC face of the daemon, and the owner of the pipeline.
//
// Each call is validated (peer uid, session, names, bounds, versions) and turned into work
// for the stages: Register imports the trainer's regions and reads its descriptor table;
// Snapshot plans a shard and queues it on the SnapshotEngine (copy), which feeds the
// FlushEngine (write), whose durable shards go to the Catalog (commit); Restore runs the
// RestoreEngine. Errors become gRPC statuses whose message says what is wrong; nothing a
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
#include "daemon/catalog.h"
#include "daemon/config.h"
#include "daemon/device_copier.h"
#include "daemon/flush_engine.h"
#include "daemon/host_pool.h"
#include "daemon/peer_registry.h"
#include "daemon/region_importer.h"
#include "daemon/restore_engine.h"
#include "daemon/snapshot_engine.h"
#include "daemon/storage.h"
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

 private:
  struct Session;

  explicit CheckpointService(const Config& config) : config_(config) {}

  ckpt::Status CheckPeer(grpc::ServerContext* ctx, PeerCredentials* peer) const;
  ckpt::Status FindSession(grpc::ServerContext* ctx, const std::string& id, std::shared_ptr<Session>* out);
  ckpt::Status LoadTable(Session& s);
  // Opens (or checks) the session's device events after LoadTable found device regions.
  ckpt::Status AttachDevice(Session& s, const v1::RegisterRequest& req, v1::RegisterReply* reply);
  void CloseSession(const std::shared_ptr<Session>& s, bool trainer_gone);
  void OnDurable(const std::shared_ptr<ShardJob>& shard);
  void OnFailed(const std::shared_ptr<ShardJob>& shard);
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
  // Shards of each (job, version) in this daemon, so a commit can raise all of them.
  std::map<std::pair<std::string, std::uint64_t>, std::vector<std::weak_ptr<ShardJob>>> by_version_;
  // Ranks whose shard of (job, version) this daemon made durable since that rank last
  // restored. Only these count towards a commit: a shard file left by an earlier run (a
  // crash before its version committed) must never complete a version of this run.
  std::map<std::pair<std::string, std::uint64_t>, std::set<std::uint32_t>> published_;
  // Bumped for a (job, rank) by every registration and restore: shards snapshotted under an
  // older epoch (a dead trainer's versions still in flight) never count towards a commit.
  std::map<std::pair<std::string, std::uint32_t>, std::uint64_t> rank_epoch_;
  // Starts a new epoch for the rank (caller holds mu_); returns it.
  std::uint64_t NewEpochLocked(const std::string& job, std::uint32_t rank);
  std::deque<std::shared_ptr<ShardJob>> recent_;  // for Status: in flight and recently done
  std::deque<std::string> errors_;

  std::atomic<std::uint64_t> bytes_read_total_{0};
  std::atomic<std::uint64_t> committed_total_{0};
  std::atomic<std::uint64_t> copied_done_total_{0};
  std::atomic<std::uint64_t> written_done_total_{0};

  std::mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace ckpt
