// ckptctl: look at a running ckptd (status, ls) or at checkpoint files (verify, inspect).
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cinttypes>
#include <cstdio>
#include <iostream>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "common/socket_path.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "proto/level_codec.h"

namespace {

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

std::unique_ptr<ckpt::v1::Checkpoint::Stub> Connect(const std::string& socket) {
  return ckpt::v1::Checkpoint::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

int Fail(const std::string& what, const grpc::Status& s, const std::string& socket) {
  std::cerr << "ckptctl: " << what << ": ";
  // The refusals of a daemon shared by many users: say which kind it is.
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) std::cerr << "PERMISSION_DENIED: ";
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) std::cerr << "RESOURCE_EXHAUSTED: ";
  std::cerr << s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE)
    std::cerr << " (is ckptd running on " << socket << "?)";
  std::cerr << "\n";
  return 1;
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  opts.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  return out;
}

int Status(const std::string& socket, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ckpt::v1::StatusReply r;
  grpc::Status s = stub->Status(&ctx, ckpt::v1::StatusRequest(), &r);
  if (!s.ok()) return Fail("status", s, socket);
  if (json) {
    std::cout << ToJson(r);
    return 0;
  }
  std::printf("ckptd %s  pid %d  up %" PRIu64 " s  socket %s\n", r.daemon_version().c_str(), r.pid(),
              r.uptime_s(), socket.c_str());
  std::printf("root %s (%s)\n", r.root().c_str(), r.direct_io() ? "O_DIRECT" : "buffered + fdatasync");
  std::printf("pool %s used of %s (%s chunks; NUMA %s)\n", Human(r.pool_used_bytes()).c_str(),
              Human(r.pool_bytes()).c_str(), Human(r.chunk_bytes()).c_str(), r.pool_numa().c_str());
  std::printf("gpu: %s\n", r.device_backend().c_str());
  std::printf("totals: copied %s, written %s, read %s, %" PRIu64 " versions committed\n",
              Human(r.bytes_copied_total()).c_str(), Human(r.bytes_written_total()).c_str(),
              Human(r.bytes_read_total()).c_str(), r.versions_committed());
  std::printf("restored: %s from memory, %s from local, %s from persistent; %u promotion(s) pending\n",
              Human(r.restored_bytes_memory()).c_str(), Human(r.restored_bytes_local()).c_str(),
              Human(r.restored_bytes_persistent()).c_str(), r.promotions_pending());
  std::printf("\ntiers\n");
  for (const auto& t : r.tiers()) {
    if (t.name() == "memory") {
      std::printf("  %-10s %" PRIu64 " shard(s), %s of %s; keeps %s\n", t.name().c_str(), t.shards(),
                  Human(t.bytes()).c_str(), Human(t.budget_bytes()).c_str(), t.retention().c_str());
    } else {
      std::printf("  %-10s %s; keeps %s\n", t.name().c_str(), t.dir().c_str(), t.retention().c_str());
    }
  }
  std::printf("\nclients (%d)\n", r.clients_size());
  for (const auto& c : r.clients()) {
    std::printf("  job %-16s rank %u/%u  pid %-7d %s  %u items %s  last version %" PRIu64 "\n",
                c.job().c_str(), c.rank(), c.world_size(), c.pid(), c.alive() ? "alive" : "EXITED", c.items(),
                Human(c.tensor_bytes()).c_str(), c.last_version());
  }
  std::printf("\nshards (recent %d)\n", r.shards_size());
  for (const auto& sh : r.shards()) {
    std::printf("  job %-16s v%-8" PRIu64 " rank %-4u %-9s copied %s / written %s / %s%s%s\n",
                sh.job().c_str(), sh.version(), sh.rank(),
                sh.error().empty() ? ckpt::LevelName(ckpt::LevelFromProto(sh.level())) : "FAILED",
                Human(sh.copied_bytes()).c_str(), Human(sh.written_bytes()).c_str(),
                Human(sh.total_bytes()).c_str(), sh.error().empty() ? "" : "  ", sh.error().c_str());
  }
  std::printf("\nerrors (%d)\n", r.errors_size());
  for (const auto& e : r.errors()) std::printf("  %s\n", e.c_str());
  return 0;
}

int Ls(const std::string& socket, const std::string& job, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  ckpt::v1::ListRequest req;
  req.set_job(job);
  ckpt::v1::ListReply r;
  grpc::Status s = stub->List(&ctx, req, &r);
  if (!s.ok()) return Fail("ls", s, socket);
  if (json) {
    std::cout << ToJson(r);
    return 0;
  }
  std::printf("job %s: latest committed %" PRIu64 "\n", job.c_str(), r.latest());
  auto join = [](const auto& ranks) {
    std::string out;
    for (auto rk : ranks) out += (out.empty() ? "" : ",") + std::to_string(rk);
    return out.empty() ? std::string("-") : out;
  };
  std::printf("  %-11s %-11s %-16s %-16s %s\n", "version", "state", "persistent ranks", "local ranks",
              "memory ranks");
  for (const auto& v : r.versions()) {
    std::printf("  v%-10" PRIu64 " %-11s %-16s %-16s %s\n", v.version(),
                v.committed() ? "committed" : "incomplete", join(v.durable_ranks()).c_str(),
                join(v.local_ranks()).c_str(), join(v.memory_ranks()).c_str());
  }
  return 0;
}

int Prefetch(const std::string& socket, const std::string& job, std::uint64_t version,
             const std::vector<std::uint32_t>& ranks) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ckpt::v1::PrefetchRequest req;
  req.set_job(job);
  req.set_version(version);
  for (auto r : ranks) req.add_ranks(r);
  ckpt::v1::PrefetchReply r;
  grpc::Status s = stub->Prefetch(&ctx, req, &r);
  if (!s.ok()) return Fail("prefetch", s, socket);
  std::printf("job %s version %" PRIu64 ": %u shard(s) copied to the local tier, %u into memory, %s read\n",
              job.c_str(), r.version(), r.local_shards(), r.memory_shards(), Human(r.bytes()).c_str());
  return 0;
}

// The daemon's metrics, as GET /metrics serves them (docs/ops/metrics.md); --json wraps the
// text in {"text": ...}.
int Metrics(const std::string& socket, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ckpt::v1::GetMetricsReply r;
  grpc::Status s = stub->GetMetrics(&ctx, ckpt::v1::GetMetricsRequest(), &r);
  if (!s.ok()) return Fail("metrics", s, socket);
  std::fputs(json ? (ToJson(r) + "\n").c_str() : r.text().c_str(), stdout);
  return 0;
}

int Inspect(const std::string& path) {
  auto info = ckpt::ReadShardHeader(path);
  if (!info.ok()) {
    std::cerr << "ckptctl: " << info.status().message() << "\n";
    return 1;
  }
  std::printf("%s: job %s version %" PRIu64 " rank %u of %u, %zu items, data at offset %" PRIu64 ", %s\n",
              path.c_str(), info->meta.job.c_str(), info->meta.version, info->meta.rank,
              info->meta.world_size, info->items.size(), info->data_start, Human(info->file_bytes).c_str());
  for (const auto& it : info->items) {
    std::string shape;
    for (auto d : it.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    std::printf("  %-6s %-40s %-7s [%s] %s xxh3 %s\n", it.kind == ckpt::ItemKind::kBlob ? "blob" : "tensor",
                it.name.c_str(), std::string(ckpt::DTypeName(it.dtype)).c_str(), shape.c_str(),
                Human(it.length).c_str(), ckpt::ChecksumHex(it.checksum).c_str());
  }
  return 0;
}

int Verify(const std::vector<std::string>& paths) {
  int bad = 0;
  for (const auto& p : paths) {
    ckpt::Status s = ckpt::VerifyShard(p);
    if (s.ok()) {
      std::printf("ok      %s\n", p.c_str());
    } else {
      std::printf("FAILED  %s\n", s.message().c_str());
      ++bad;
    }
  }
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckptctl: inspect ckptd and its checkpoints"};
  std::string socket = ckpt::DefaultClientSocketPath();
  app.add_option("--socket", socket, "ckptd socket")->capture_default_str();
  app.require_subcommand(1);
  bool json = false;
  auto* status = app.add_subcommand("status", "What the daemon is doing");
  status->add_flag("--json", json, "Print JSON");
  std::string job;
  auto* ls = app.add_subcommand("ls", "Versions of a job");
  ls->add_option("--job", job, "Job id")->required();
  ls->add_flag("--json", json, "Print JSON");
  std::uint64_t version = 0;
  std::vector<std::uint32_t> ranks;
  auto* prefetch = app.add_subcommand(
      "prefetch",
      "Pull a committed version from the persistent tier into this daemon's local and memory tiers");
  prefetch->add_option("--job", job, "Job id")->required();
  prefetch->add_option("--version", version, "Committed version (default: the newest)");
  prefetch->add_option("--ranks", ranks, "Ranks this node will serve (default: all)")->delimiter(',');
  std::vector<std::string> paths;
  auto* verify = app.add_subcommand("verify", "Check shard files against their checksums (no daemon needed)");
  verify->add_option("shards", paths, "Shard files")->required()->check(CLI::ExistingFile);
  std::string path;
  auto* inspect = app.add_subcommand("inspect", "Print a shard's header (no daemon needed)");
  inspect->add_option("shard", path, "Shard file")->required()->check(CLI::ExistingFile);
  auto* metrics = app.add_subcommand("metrics", "The daemon's metrics in Prometheus text format");
  metrics->add_flag("--json", json, "Print JSON");
  CLI11_PARSE(app, argc, argv);
  if (*status) return Status(socket, json);
  if (*ls) return Ls(socket, job, json);
  if (*prefetch) return Prefetch(socket, job, version, ranks);
  if (*verify) return Verify(paths);
  if (*inspect) return Inspect(path);
  if (*metrics) return Metrics(socket, json);
  return 2;
}
