// The `export` subcommand: runs an export (export.h) and reports it, on stdout what was
// written and on stderr, each on a line starting "ckptctl: export:", what went wrong.
#include <csignal>
#include <cstdio>
#include <iostream>

#include "tools/ckptctl/commands.h"
#include "tools/ckptctl/common.h"
#include "tools/ckptctl/export.h"

namespace ckptctl {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;

void OnSignal(int) { g_interrupted = 1; }

int ExitCode(const ckpt::Status& s) {
  switch (s.code()) {
    case ckpt::StatusCode::kInvalidArgument:     // a bad regex, a bad size, a bad job id
    case ckpt::StatusCode::kAlreadyExists:       // --out has files in it, no --force
    case ckpt::StatusCode::kFailedPrecondition:  // --out is not a directory
      return kUsage;
    case ckpt::StatusCode::kNotFound:  // job, version, committed version, a filter that matches nothing
      return kNotFound;
    case ckpt::StatusCode::kDataLoss:  // a shard or the index fails its checks, chunks that do not tile
      return kCorrupt;
    default:  // the output cannot be written, a read failed, interrupted
      return kFailure;
  }
}

}  // namespace

int Export(const ExportOptions& options, bool json) {
  ExportOptions opts = options;
  opts.interrupted = &g_interrupted;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  auto report = RunExport(opts);
  if (!report.ok()) {
    std::cerr << "ckptctl: export: " << report.status().message() << "\n";
    return ExitCode(report.status());
  }
  for (const auto& w : report->warnings) std::cerr << "ckptctl: export: warning: " << w << "\n";
  if (json) {
    nlohmann::ordered_json files = nlohmann::ordered_json::array();
    for (const auto& f : report->files) {
      nlohmann::ordered_json names = nlohmann::ordered_json::array();
      for (std::size_t i : f.tensors) names.push_back(report->tensor_names[i]);
      files.push_back({{"name", f.name}, {"data_bytes", f.data_bytes}, {"tensors", std::move(names)}});
    }
    PrintJson({{"job", report->job},
               {"version", report->version},
               {"world_size", report->world_size},
               {"from_index", report->from_index},
               {"out", report->out},
               {"total_size", report->total_size},
               {"tensors", report->tensor_names.size()},
               {"skipped_blobs", report->skipped_blobs},
               {"files", std::move(files)},
               {"warnings", report->warnings}});
    return kOk;
  }
  std::printf("exported job %s version %llu (%u ranks): %zu tensors, %s in %zu files to %s\n",
              report->job.c_str(), static_cast<unsigned long long>(report->version), report->world_size,
              report->tensor_names.size(), Human(report->total_size).c_str(), report->files.size(),
              report->out.c_str());
  for (const auto& f : report->files)
    std::printf("  %-36s %6zu tensors %s\n", f.name.c_str(), f.tensors.size(), Human(f.data_bytes).c_str());
  std::printf("  %s\n", std::string(kExportIndexName).c_str());
  if (report->skipped_blobs > 0)
    std::printf("%zu blobs not exported (--blobs exports them as U8 tensors rank<R>/__blob__/<name>)\n",
                report->skipped_blobs);
  if (!report->from_index)
    std::printf("the version has no index.json: its tensors were read from the shard headers\n");
  return kOk;
}

}  // namespace ckptctl
