// The status report as ckptctl shows it: its JSON (status --json), and the frames of
// status --watch, with the throughput computed from the totals of two reports.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/v1/ckpt.pb.h"

namespace ckptctl {

// Bytes per second copied and written between two reports.
struct Throughput {
  double interval_s = 0;
  double copy_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};

// From the totals of `before` and `after`, taken `interval_s` apart; nullopt when they
// cannot be compared (another daemon instance, or no time between them).
std::optional<Throughput> ThroughputBetween(const ckpt::v1::StatusReply& before,
                                            const ckpt::v1::StatusReply& after, double interval_s);

// Whether a shard is still on its way to the persistent tier (in progress or unsealed, not
// yet persisted).
bool InFlight(const ckpt::v1::ShardStatus& shard);
// What a text view prints after a shard that did not make it: "  by v10: <why>" for one
// skipped for version 10, "  <why>" for an aborted or failed one, else "".
std::string ShardNote(const ckpt::v1::ShardStatus& shard);
// Whether a shard the report lists is FAILED: the exit code of status (skipped and aborted
// shards are no failure).
bool AnyShardFailed(const ckpt::v1::StatusReply& r);
// The tiers of `status`, one block each: what each holds, per job, and the memory tier's
// budget split into held, in flight and reusable; then the line of data in flight.
std::string TierLines(const ckpt::v1::StatusReply& r);
// The tiers in one line, for a frame of status --watch.
std::string TierSummary(const ckpt::v1::StatusReply& r);

// Peer replication (empty when it is off): what this daemon sent, holds and restored, each
// peer, and per job whether its newest committed version is fully replicated.
std::string ReplicationLines(const ckpt::v1::StatusReply& r);
// The versions that wait for their commit longer than expected, and which ranks they miss
// (empty when none).
std::string StalledVersionLines(const ckpt::v1::StatusReply& r);
// The error log, one line per distinct message, a repeated one with its count and when it
// was last seen.
std::string ErrorLines(const ckpt::v1::StatusReply& r);

// The reply as JSON (json.h), each shard with "in_flight" added.
nlohmann::ordered_json StatusJson(const ckpt::v1::StatusReply& r);

// "[######====..........]": `width` cells, '#' written, '=' copied but not yet written,
// '.' still to copy.
std::string ProgressBar(std::uint64_t written, std::uint64_t copied, std::uint64_t total, int width);

// One frame of status --watch.
std::string RenderFrame(const ckpt::v1::StatusReply& r, const std::optional<Throughput>& rate,
                        const std::string& socket);

}  // namespace ckptctl
