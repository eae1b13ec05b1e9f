#include "daemon/rpc/warm_start_rpc.h"

#include <unistd.h>

#include "common/names.h"
#include "proto/grpc_status.h"

namespace ckpt {

grpc::Status HandleWarmStart(Daemon& daemon, const PeerCredentials& peer, const v1::WarmStartRequest& req,
                             v1::WarmStartReply* reply) {
  if (std::string err = CheckJobId(req.job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  if (Status st = daemon.owners().CheckAccess(req.job(), peer, "warm-start"); !st.ok()) return ToGrpc(st);
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
