// The Checkpoint service's face of the warm start (daemon/replication/warm_start.h): the
// WarmStart call and the warm starts' part of the Status report. Kept apart from
// service.cc and status_report.cc, which call these. Thread-safe as the WarmStart is.
#pragma once

#include <grpcpp/grpcpp.h>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "daemon/daemon.h"
#include "daemon/session/peer_registry.h"

namespace ckpt {

// WarmStart for `peer` (already authenticated): the job's owner (or a member of its group)
// or root; FAILED_PRECONDITION without peer replication; the WarmStart's own errors.
grpc::Status HandleWarmStart(Daemon& daemon, const PeerCredentials& peer, const v1::WarmStartRequest& req,
                             v1::WarmStartReply* reply);

// The warm starts of the jobs `viewer` may see (root and the daemon's uid: all).
void FillWarmStartStatus(Daemon& daemon, const PeerCredentials& viewer, v1::StatusReply* reply);

}  // namespace ckpt
