// The Jobs RPC's report: every job on the persistent tier (a directory under the root) and
// every job a session of this daemon registered, with its owner, versions and bytes. Root
// and the daemon's own uid see every job; any other uid sees the jobs it may list
// (session/job_owners.h: its own, those shared with one of its groups, and jobs without an
// owner file), as the status report shows the shards of those jobs. Bytes per tier: the
// persistent tier's shard files, and what this daemon's memory and local tiers hold.
#pragma once

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/daemon.h"
#include "daemon/session/peer_registry.h"

namespace ckpt {

// An error only when the root cannot be listed; a job that cannot be read fully is listed
// with its error.
Status FillJobsReport(Daemon& daemon, const PeerCredentials& viewer, v1::JobsReply* reply);

}  // namespace ckpt
