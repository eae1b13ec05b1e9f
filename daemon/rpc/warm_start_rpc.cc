#include "daemon/rpc/warm_start_rpc.h"

#include <unistd.h>

#include "common/names.h"
#include "daemon/replication/warm_start.h"
#include "proto/grpc_status.h"

namespace ckpt {

grpc::Status HandleWarmStart(Daemon& daemon, const PeerCredentials& peer, const v1::WarmStartRequest& req,
                             v1::WarmStartReply* reply) {
  if (std::string err = CheckJobId(req.job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  if (Status st = daemon.owners().CheckAccess(req.job(), peer, "warm-start"); !st.ok()) return ToGrpc(st);
  // Ranks named by hand are pulled whoever sent them, into memory other jobs use too: that
  // is for root and the daemon's user (an operator rebuilding a node). Others warm-start what
  // the peers hold as sent by this node's address.
  if (!req.ranks().empty() && peer.uid != 0 && peer.uid != ::geteuid()) {
    return ToGrpc(PermissionDenied("naming the ranks of a warm start (--ranks) is for root and the daemon's user; uid " +
                                   std::to_string(peer.uid) +
                                   " may warm-start the ranks the peers hold from this node (no --ranks)"));
  }
  if (req.ranks_size() > static_cast<int>(kMaxWarmStartRanks)) {
    return ToGrpc(InvalidArgument("a warm start names " + std::to_string(req.ranks_size()) + " ranks; at most " +
                                  std::to_string(kMaxWarmStartRanks) + " in one call"));
  }
  WarmStart* warm = daemon.warm_start();
  if (warm == nullptr) {
    return ToGrpc(FailedPrecondition(
        "this daemon does not replicate (--replicas 0): there are no peers to warm-start job '" + req.job() +
        "' from (`ckptctl prefetch` without --from-peers reads the persistent tier)"));
  }
  auto plan = warm->Start(req.job(), std::vector<std::uint32_t>(req.ranks().begin(), req.ranks().end()));
  if (!plan.ok()) return ToGrpc(plan.status());
  reply->set_version(plan->version);
  reply->set_shards(plan->shards);
  reply->set_total_bytes(plan->total_bytes);
  return grpc::Status::OK;
}

void FillWarmStartStatus(Daemon& daemon, const PeerCredentials& viewer, v1::StatusReply* reply) {
  WarmStart* warm = daemon.warm_start();
  if (warm == nullptr) return;
  const bool all = viewer.uid == 0 || viewer.uid == ::geteuid();
  for (const auto& j : warm->Progress()) {
    if (!all && !daemon.owners().CheckAccess(j.job, viewer, "see").ok()) continue;
    auto* out = reply->add_warm_starts();
    out->set_job(j.job);
    out->set_version(j.version);
    out->set_state(WarmStateName(j.state));
    out->set_bytes_done(j.bytes_done);
    out->set_total_bytes(j.total_bytes);
    out->set_error(j.error);
    for (const auto& s : j.shards) {
      auto* sh = out->add_shards();
      sh->set_rank(s.rank);
      sh->set_state(WarmStateName(s.state));
      sh->set_bytes_done(s.bytes_done);
      sh->set_total_bytes(s.total_bytes);
      sh->set_peer(s.peer);
      sh->set_error(s.error);
    }
  }
}

}  // namespace ckpt
