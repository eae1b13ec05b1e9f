// The Status RPC's report: the daemon, its clients, its recent shards, its tiers and its
// counters, gathered without blocking on a busy session (a session in a long call shows no
// item counts rather than delaying the report).
#pragma once

#include "ckpt/v1/ckpt.pb.h"
#include "daemon/daemon.h"

namespace ckpt {

void FillStatusReport(Daemon& daemon, v1::StatusReply* reply);

}  // namespace ckpt
