// The Status RPC's report: the daemon, its clients, its recent shards, its tiers and its
// counters, gathered without blocking on a busy session (a session in a long call shows no
// item counts rather than delaying the report). Root and the daemon's own uid see
// everything; any other uid sees only its own sessions, the shards of the jobs it may use
// (session/job_owners.h) and the errors that name one of those jobs.
#pragma once

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/daemon.h"
#include "daemon/session/peer_registry.h"

namespace ckpt {

void FillStatusReport(Daemon& daemon, const PeerCredentials& viewer, v1::StatusReply* reply);

}  // namespace ckpt
