// What every ckptctl subcommand shares: the exit codes, the connection to the daemon, the
// reporting of a failed call, and the printing of sizes and JSON.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/v1/ckpt.grpc.pb.h"

namespace ckptctl {

// The exit codes (docs/ops/ckptctl.md). 0, 1 and 2 are those of ckptd itself.
enum Exit : int {
  kOk = 0,
  kFailure = 1,      // the daemon is unreachable or went away, or a call or a read failed
  kUsage = 2,        // bad command line, or an argument the daemon refuses (INVALID_ARGUMENT)
  kNotFound = 3,     // no such job, version, shard or file
  kCorrupt = 4,      // verify: a shard failed its checks
  kShardFailed = 5,  // status: a shard it lists is FAILED (a real error; skipped and aborted are not)
};

std::unique_ptr<ckpt::v1::Checkpoint::Stub> Connect(const std::string& socket);

// A deadline `seconds` from now for a call to the daemon.
void SetDeadline(grpc::ClientContext& ctx, int seconds);

// Prints why call `what` failed and returns its exit code: kNotFound for NOT_FOUND, kUsage
// for INVALID_ARGUMENT (the daemon refused what was typed), kFailure otherwise.
int Fail(const std::string& what, const grpc::Status& s, const std::string& socket);

// "1.5 MiB".
std::string Human(std::uint64_t bytes);

// The short lower-case word of a wire level: "copying" (none yet), "captured", "local",
// "persisted", "committed".
const char* LevelWord(ckpt::v1::Level level);
// The state as --json writes it: "in_progress", "unsealed", "committed", "skipped",
// "aborted", "failed" ("unspecified": a daemon that does not report states).
const char* StateWord(ckpt::v1::ShardState state);
// A shard's state in one word for the text views, as the daemon reports it (`state`): FAILED
// (a real error), ABORTED (a torn snapshot, not an error of the daemon), "skipped"
// (superseded by a newer version before it was persisted), "unsealed" (written, waiting for
// its trainer's seal), "committed", else the level an in-progress shard has reached.
const char* ShardWord(const ckpt::v1::ShardStatus& shard);

// Prints `doc` on stdout, indented, with a final newline.
void PrintJson(const nlohmann::ordered_json& doc);

}  // namespace ckptctl
