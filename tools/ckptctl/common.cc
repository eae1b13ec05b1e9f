#include "tools/ckptctl/common.h"

#include <cinttypes>
#include <cstdio>
#include <iostream>

#include "proto/level_codec.h"

namespace ckptctl {

std::unique_ptr<ckpt::v1::Checkpoint::Stub> Connect(const std::string& socket) {
  return ckpt::v1::Checkpoint::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

void SetDeadline(grpc::ClientContext& ctx, int seconds) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

int Fail(const std::string& what, const grpc::Status& s, const std::string& socket) {
  std::cerr << "ckptctl: " << what << ": ";
  // The refusals of a daemon shared by many users: say which kind it is.
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) std::cerr << "PERMISSION_DENIED: ";
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) std::cerr << "RESOURCE_EXHAUSTED: ";
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) std::cerr << "NOT_FOUND: ";
  if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT) std::cerr << "INVALID_ARGUMENT: ";
  std::cerr << s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE)
    std::cerr << " (is ckptd running on " << socket << "?)";
  std::cerr << "\n";
  switch (s.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
      return kNotFound;
    case grpc::StatusCode::INVALID_ARGUMENT:  // what was typed is wrong (a job id like ../etc)
      return kUsage;
    default:
      return kFailure;
  }
}

std::string Human(std::uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  else if (bytes >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1ull << 20));
  else if (bytes >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(bytes) / 1024);
  else
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
  return buf;
}

const char* LevelWord(ckpt::v1::Level level) { return ckpt::LevelName(ckpt::LevelFromProto(level)); }

const char* StateWord(ckpt::v1::ShardState state) {
  switch (state) {
    case ckpt::v1::SHARD_STATE_IN_PROGRESS:
      return "in_progress";
    case ckpt::v1::SHARD_STATE_UNSEALED:
      return "unsealed";
    case ckpt::v1::SHARD_STATE_COMMITTED:
      return "committed";
    case ckpt::v1::SHARD_STATE_SKIPPED:
      return "skipped";
    case ckpt::v1::SHARD_STATE_ABORTED:
      return "aborted";
    case ckpt::v1::SHARD_STATE_FAILED:
      return "failed";
    default:
      return "unspecified";
  }
}

const char* ShardWord(const ckpt::v1::ShardStatus& shard) {
  switch (shard.state()) {
    case ckpt::v1::SHARD_STATE_FAILED:
      return "FAILED";
    case ckpt::v1::SHARD_STATE_ABORTED:
      return "ABORTED";
    case ckpt::v1::SHARD_STATE_SKIPPED:
    case ckpt::v1::SHARD_STATE_UNSEALED:
    case ckpt::v1::SHARD_STATE_COMMITTED:
      return StateWord(shard.state());
    default:  // in progress: how far it has come
      return LevelWord(shard.level());
  }
}

void PrintJson(const nlohmann::ordered_json& doc) {
  // Replace rather than throw on bytes that are not UTF-8 (a string field holds any bytes).
  std::cout << doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
}

}  // namespace ckptctl
