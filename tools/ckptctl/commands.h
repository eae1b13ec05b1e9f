// The subcommands of ckptctl, one function each; main (tools/ckptctl.cc) parses the command
// line and calls one. Each returns its exit code (common.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/ckptctl/export.h"

namespace ckptctl {

// Where a checkpoint tree's shard is, for verify and inspect without a daemon: every shard
// of a version (rank unset) or one.
struct TreeSelection {
  std::string root;
  std::string job;
  std::uint64_t version = 0;  // 0: the newest committed
  std::int64_t rank = -1;     // -1: every rank
};

int Status(const std::string& socket, bool json);
// Redraws every `interval_s` until SIGINT/SIGTERM (exit 0), `count` frames (0: no limit)
// or the daemon going away (exit 1).
int Watch(const std::string& socket, double interval_s, std::uint64_t count, bool json);
int Ls(const std::string& socket, const std::string& job, bool ask_peers, bool json);
int Jobs(const std::string& socket, bool json);
int Prefetch(const std::string& socket, const std::string& job, std::uint64_t version,
             const std::vector<std::uint32_t>& ranks, bool json);
// FinishJob: the job's memory images here and its replicas at the peers go.
int Finish(const std::string& socket, const std::string& job, bool json);
int Metrics(const std::string& socket, bool json);
// `paths` and the shards of `tree` (if its root is set).
int Verify(std::vector<std::string> paths, const TreeSelection& tree, bool json);
int Inspect(std::vector<std::string> paths, const TreeSelection& tree, bool json);
// Consolidates a committed version into Hugging Face safetensors files (export.h).
int Export(const ExportOptions& options, bool json);

}  // namespace ckptctl
