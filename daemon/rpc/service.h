// CheckpointService: the gRPC face of the daemon (ckpt.v1.Checkpoint). Each handler enters
// the call gate (rpc/call_gate.h: shutdown ends waiting calls at once), checks the peer and
// whether it may use the job it names (session/job_owners.h), validates what the request
// alone can tell, delegates to the part that does the work (daemon/session/,
// daemon/tiers/) and fills the reply; translations live in rpc/convert.h, the status
// report in rpc/status_report.h. Errors become gRPC statuses whose message says what is
// wrong; nothing a client sends stops the daemon serving the others. Thread-safe (gRPC
// calls it from many threads).
#pragma once

#include <grpcpp/grpcpp.h>

#include <set>
#include <string>
#include <string_view>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "common/mutex.h"
#include "daemon/daemon.h"
#include "daemon/rpc/call_gate.h"
#include "daemon/rpc/peer_auth.h"
#include "format/limits.h"

namespace ckpt {

class CheckpointService final : public v1::Checkpoint::Service {
 public:
  // The largest world size a registration may declare: the largest readers of the tree take.
  static constexpr std::uint32_t kMaxWorldSize = ckpt::kMaxWorldSize;

  // `peers` null: in-process use (every caller is this process).
  CheckpointService(Daemon& daemon, const PeerRegistry* peers)
      : daemon_(daemon), auth_(peers, daemon.config().allow_uids), instance_(NewDaemonInstanceId()) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*, v1::RegisterReply*) override;
  grpc::Status Snapshot(grpc::ServerContext*, const v1::SnapshotRequest*, v1::SnapshotReply*) override;
  grpc::Status Wait(grpc::ServerContext*, const v1::WaitRequest*, v1::WaitReply*) override;
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest*, v1::RestoreReply*) override;
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*, v1::ListReply*) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusReply*) override;
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterReply*) override;
  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortReply*) override;
  grpc::Status Prefetch(grpc::ServerContext*, const v1::PrefetchRequest*, v1::PrefetchReply*) override;
  grpc::Status WarmStart(grpc::ServerContext*, const v1::WarmStartRequest*, v1::WarmStartReply*) override;
  grpc::Status FinishJob(grpc::ServerContext*, const v1::FinishJobRequest*, v1::FinishJobReply*) override;
  grpc::Status Jobs(grpc::ServerContext*, const v1::JobsRequest*, v1::JobsReply*) override;
  grpc::Status GetMetrics(grpc::ServerContext*, const v1::GetMetricsRequest*, v1::GetMetricsReply*) override;

  // Shutdown: BeginShutdown(), then AwaitIdle() before the server is shut down.
  CallGate& gate() { return gate_; }

 private:
  // The caller's session `id`, checked against the caller's uid.
  Result<std::shared_ptr<Session>> FindSession(grpc::ServerContext* ctx, const std::string& id);
  // A wait with `seal` on a sealed registration's shard: waits for its capture (unless
  // `ordered`), verifies it for a verify registration (aborting it if its memory changed),
  // then seals it. The shard's error, the verification's, or kCancelled / kDeadlineExceeded.
  ckpt::Status SealAtWait(grpc::ServerContext* ctx, const std::shared_ptr<ShardJob>& shard, bool ordered,
                          std::chrono::steady_clock::time_point deadline);

  // Jobs a trainer unregistered from as finished while others of them were still registered
  // here: finished once the last one unregisters.
  Mutex finishing_mu_;
  std::set<std::string> finishing_ GUARDED_BY(finishing_mu_);
  // A job-scoped call: the caller is allowed on this socket, `job` is a valid id, and the
  // caller may do `action` to it (its owner, its group, root). The refusal otherwise.
  ckpt::Status AuthorizeJob(grpc::ServerContext* ctx, const std::string& job, std::string_view action);
  // Whether a session of `job` is registered on this daemon.
  bool HasSessionOf(const std::string& job);
  // Drops the job's memory images here and tells the peers to drop the replicas sent them.
  void FinishJobHere(const std::string& job, v1::FinishJobReply* reply);

  // A random id, new in every daemon process (RegisterReply.daemon_instance): how a client
  // tells a restarted daemon from the one it registered with.
  static std::string NewDaemonInstanceId();

  Daemon& daemon_;
  const PeerAuth auth_;
  const std::string instance_;
  CallGate gate_;
};

}  // namespace ckpt
