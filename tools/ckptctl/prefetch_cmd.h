// `ckptctl prefetch --from-peers`: the warm start from peers' memory (the daemon's
// WarmStart call, daemon/replication/warm_start.h), and how `ckptctl status` shows warm
// starts. The plain `prefetch` (from the persistent tier) is in daemon_cmds.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/v1/ckpt.pb.h"

namespace ckptctl {

// Queues the warm start of `job` (`ranks`, or empty: those peers hold as sent by this
// daemon's node) and prints what it queued; with `wait`, follows it until it is done (exit
// 0) or failed (exit 1, the reason printed). Refusals: the call's exit code (common.h).
int PrefetchFromPeers(const std::string& socket, const std::string& job, const std::vector<std::uint32_t>& ranks,
                      bool wait, bool json);

// The warm starts of a Status reply, as `ckptctl status` prints them (nothing if none).
void PrintWarmStarts(const ckpt::v1::StatusReply& r);

}  // namespace ckptctl
