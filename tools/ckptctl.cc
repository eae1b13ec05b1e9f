// ckptctl: look at a running ckptd (status, ls, jobs, prefetch, finish, metrics) or at checkpoint files
// (verify, inspect, export). The subcommands live in tools/ckptctl/ (commands.h); here the command
// line is parsed and one of them called. Exit codes: tools/ckptctl/common.h.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "common/socket_path.h"
#include "tools/ckptctl/commands.h"
#include "tools/ckptctl/common.h"
#include "tools/ckptctl/prefetch_cmd.h"

namespace {

// CLI11's own PositiveNumber and NonNegativeNumber print their range up to DBL_MAX in full.
const CLI::Validator NonNegative(
    [](std::string& value) {
      double v = -1;
      return CLI::detail::lexical_cast(value, v) && v >= 0 ? std::string()
                                                           : "must be a number of 0 or more, not " + value;
    },
    "NON-NEGATIVE");
const CLI::Validator Positive(
    [](std::string& value) {
      double v = 0;
      return CLI::detail::lexical_cast(value, v) && v > 0 ? std::string()
                                                          : "must be a number above 0, not " + value;
    },
    "POSITIVE");

}  // namespace

int main(int argc, char** argv) {
  using namespace ckptctl;
  CLI::App app{"ckptctl: inspect ckptd and its checkpoints"};
  // Set before the subcommands are added, which copy both. Fallthrough: `ckptctl status --socket X`
  // works as well as `ckptctl --socket X status`.
  app.fallthrough();
  // Every error line starts with "ckptctl:" (docs/ops/ckptctl.md), CLI11's own included.
  app.failure_message(
      [](const CLI::App* a, const CLI::Error& e) { return "ckptctl: " + CLI::FailureMessage::simple(a, e); });
  std::string socket = ckpt::DefaultClientSocketPath();
  app.add_option("--socket", socket, "ckptd socket ($CKPTD_SOCKET, else /run/ckptd/ckptd.sock)")
      ->capture_default_str();
  app.require_subcommand(1);
  bool json = false;
  auto json_flag = [&json](CLI::App* sub) {
    sub->add_flag("--json", json, "Print JSON (docs/ops/ckptctl.md)");
  };

  auto* status = app.add_subcommand("status", "What the daemon is doing (exit 5 if a shard it lists FAILED)");
  double watch_s = 0;
  std::uint64_t count = 0;
  auto* watch = status->add_option("--watch", watch_s, "Redraw every SECONDS (default 2) until Ctrl-C")
                    ->expected(0, 1)
                    ->default_str("2")
                    ->check(Positive);
  status->add_option("--count", count, "With --watch: stop after N frames")->needs(watch)->check(Positive);
  json_flag(status);

  std::string job;
  auto* ls = app.add_subcommand("ls", "Versions of a job");
  ls->add_option("--job", job, "Job id")->required();
  bool ask_peers = false;
  ls->add_flag(
      "--ask-peers", ask_peers,
      "Peer replication: ask every peer which replicas of this node's shards it holds now, rather than "
      "show what they acknowledged");
  json_flag(ls);

  auto* jobs =
      app.add_subcommand("jobs", "The jobs you may see: owner, latest committed version, versions, bytes");
  json_flag(jobs);

  std::uint64_t version = 0;
  std::vector<std::uint32_t> ranks;
  auto* prefetch = app.add_subcommand(
      "prefetch",
      "Pull a committed version from the persistent tier into this daemon's local and memory tiers");
  prefetch->add_option("--job", job, "Job id")->required();
  prefetch->add_option("--version", version, "Committed version (default: the newest)");
  prefetch->add_option("--ranks", ranks, "Ranks this node will serve (default: all)")->delimiter(',');
  json_flag(prefetch);
  bool from_peers = false, wait_prefetch = false;
  auto* from_peers_flag = prefetch->add_flag(
      "--from-peers", from_peers,
      "Warm start: pull the newest committed version's shards of this node's ranks (default: those peers hold as "
      "sent by this daemon) from peers' memory into the memory tier, in the background");
  from_peers_flag->excludes(prefetch->get_option("--version"));
  prefetch->add_flag("--wait", wait_prefetch, "With --from-peers: follow it until done (0) or failed (1)")
      ->needs(from_peers_flag);

  auto* finish = app.add_subcommand("finish",
                                    "The job is over and will not restart: drop its memory images on this "
                                    "daemon and its replicas at the peers "
                                    "(files stay). Refused while a trainer of the job is registered here");
  finish->add_option("--job", job, "Job id")->required();
  json_flag(finish);

  auto* metrics = app.add_subcommand("metrics", "The daemon's metrics in Prometheus text format");
  json_flag(metrics);

  // verify and inspect take shard files, or a version of a checkpoint tree.
  std::vector<std::string> paths;
  TreeSelection tree;
  auto tree_options = [&](CLI::App* sub, const char* rank_help) {
    auto* root = sub->add_option("--root", tree.root, "Checkpoint root (with --job)");
    sub->add_option("--job", tree.job, "Job id under --root")->needs(root);
    root->needs(sub->get_option("--job"));
    sub->add_option("--version", tree.version, "Version (default: the newest committed)")->needs(root);
    sub->add_option("--rank", tree.rank, rank_help)->needs(root)->check(NonNegative);
    json_flag(sub);
  };
  auto* verify = app.add_subcommand("verify", "Check shard files against their checksums (no daemon needed)");
  verify->add_option("shards", paths, "Shard files");
  tree_options(verify, "Only this rank's shard (default: every rank)");
  auto* inspect = app.add_subcommand("inspect", "Print shard headers (no daemon needed)");
  inspect->add_option("shards", paths, "Shard files");
  tree_options(inspect, "Only this rank's shard (default: every rank)");

  // export: a committed version of a checkpoint tree, consolidated (tools/ckptctl/export.h).
  ExportOptions export_opts;
  std::string max_shard_size = "5GB";
  auto* exp = app.add_subcommand(
      "export",
      "Write a committed version as Hugging Face safetensors files (each global tensor whole, rank-private items "
      "as rank<R>/<name>) plus model.safetensors.index.json, with no daemon (docs/export.md)");
  exp->add_option("--root", export_opts.root, "Checkpoint root (the daemon's persistent tier)")->required();
  exp->add_option("--job", export_opts.job, "Job id under --root")->required();
  exp->add_option("--version", export_opts.version, "Committed version (default: the newest committed)");
  exp->add_option("--out", export_opts.out, "Directory to write (created if missing; must be empty unless --force)")
      ->required();
  exp->add_option("--filter", export_opts.filter,
                  "Export only the tensors whose exported name this regular expression finds (ECMAScript, "
                  "searched anywhere in the name: ^model\\. or /step$)");
  exp->add_option("--max-shard-size", max_shard_size,
                  "Most data bytes per file, as Hugging Face writes it: 5GB, 500MB, 2GiB, or bytes; a larger "
                  "tensor gets a file of its own")
      ->capture_default_str();
  exp->add_flag("--blobs", export_opts.blobs,
                "Export blobs too, as U8 tensors rank<R>/__blob__/<name> (default: left out, and counted)");
  exp->add_flag("--force", export_opts.force,
                "Write into a directory that has files in it: the files of an earlier export there are replaced, "
                "others (config.json, tokenizer files) kept");
  json_flag(exp);

  try {
    app.parse(argc, argv);
    if (*exp) {
      auto size = ParseByteSize(max_shard_size);
      if (!size.ok()) throw CLI::ValidationError(size.status().message());
      export_opts.max_shard_bytes = size.value();
    }
    if ((*verify || *inspect) && paths.empty() && tree.root.empty())
      throw CLI::RequiredError("shard files or --root and --job");
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kOk : kUsage;  // --help is not an error
  }
  if (*status) return watch->count() > 0 ? Watch(socket, watch_s, count, json) : Status(socket, json);
  if (*ls) return Ls(socket, job, ask_peers, json);
  if (*jobs) return Jobs(socket, json);
  if (*prefetch && from_peers) return PrefetchFromPeers(socket, job, ranks, wait_prefetch, json);
  if (*prefetch) return Prefetch(socket, job, version, ranks, json);
  if (*finish) return Finish(socket, job, json);
  if (*metrics) return Metrics(socket, json);
  if (*verify) return Verify(paths, tree, json);
  if (*inspect) return Inspect(paths, tree, json);
  if (*exp) return Export(export_opts, json);
  return kUsage;
}
