// The subcommands that ask a running ckptd: status (one report), ls, jobs, prefetch, finish, metrics.
#include <grp.h>
#include <pwd.h>

#include <cinttypes>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <vector>

#include "tools/ckptctl/commands.h"
#include "tools/ckptctl/common.h"
#include "tools/ckptctl/json.h"
#include "tools/ckptctl/prefetch_cmd.h"
#include "tools/ckptctl/status_view.h"

namespace ckptctl {
namespace {

// "uid 1000 (alice)", or "uid 1000" for a uid without a name here.
std::string DescribeUid(std::uint32_t uid) {
  std::string out = "uid " + std::to_string(uid);
  if (const passwd* pw = ::getpwuid(uid)) out += std::string(" (") + pw->pw_name + ")";
  return out;
}

std::string DescribeGid(std::uint32_t gid) {
  std::string out = "gid " + std::to_string(gid);
  if (const group* gr = ::getgrgid(gid)) out += std::string(" (") + gr->gr_name + ")";
  return out;
}

// Whether the daemon lists `job` among those the caller may see; nullopt (its error printed)
// when the question fails.
std::optional<bool> JobKnown(const std::string& socket, const std::string& job) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 30);
  ckpt::v1::JobsReply r;
  grpc::Status s = stub->Jobs(&ctx, ckpt::v1::JobsRequest(), &r);
  if (!s.ok()) {
    Fail("ls: ask which jobs exist", s, socket);
    return std::nullopt;
  }
  for (const auto& j : r.jobs()) {
    if (j.job() == job) return true;
  }
  return false;
}

}  // namespace

int Status(const std::string& socket, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 10);
  ckpt::v1::StatusReply r;
  grpc::Status s = stub->Status(&ctx, ckpt::v1::StatusRequest(), &r);
  if (!s.ok()) return Fail("status", s, socket);
  // Only a real error fails status: a skipped or an aborted shard is the design at work.
  const int rc = AnyShardFailed(r) ? kShardFailed : kOk;
  if (json) {
    PrintJson(StatusJson(r));
    return rc;
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
  std::printf("restored: %s from memory, %s from local, %s from peer, %s from persistent\n",
              Human(r.restored_bytes_memory()).c_str(), Human(r.restored_bytes_local()).c_str(),
              Human(r.restored_bytes_peer()).c_str(), Human(r.restored_bytes_persistent()).c_str());
  std::printf("\ntiers\n%s", TierLines(r).c_str());
  std::fputs(ReplicationLines(r).c_str(), stdout);
  PrintWarmStarts(r);
  std::printf("\nclients (%d)\n", r.clients_size());
  for (const auto& c : r.clients()) {
    std::printf("  job %-16s rank %u/%u  pid %-7d %s  %u items %s  last version %" PRIu64 "\n",
                c.job().c_str(), c.rank(), c.world_size(), c.pid(), c.alive() ? "alive" : "EXITED", c.items(),
                Human(c.tensor_bytes()).c_str(), c.last_version());
  }
  std::printf("\nshards (recent %d)\n", r.shards_size());
  for (const auto& sh : r.shards()) {
    std::printf("  job %-16s v%-8" PRIu64 " rank %-4u %-9s copied %s / written %s / %s%s\n", sh.job().c_str(),
                sh.version(), sh.rank(), ShardWord(sh), Human(sh.copied_bytes()).c_str(),
                Human(sh.written_bytes()).c_str(), Human(sh.total_bytes()).c_str(), ShardNote(sh).c_str());
  }
  std::fputs(StalledVersionLines(r).c_str(), stdout);
  std::printf("\nerrors (%d)\n", r.errors_size());
  std::fputs(ErrorLines(r).c_str(), stdout);
  return rc;
}

int Ls(const std::string& socket, const std::string& job, bool ask_peers, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 30);
  ckpt::v1::ListRequest req;
  req.set_job(job);
  req.set_ask_peers(ask_peers);
  ckpt::v1::ListReply r;
  grpc::Status s = stub->List(&ctx, req, &r);
  if (!s.ok()) return Fail("ls", s, socket);
  // The daemon lists a job id nobody created as empty (it takes any id); a job that exists
  // with no version yet is listed as empty too, and is not an error.
  if (r.versions().empty()) {
    const std::optional<bool> known = JobKnown(socket, job);
    if (!known) return kFailure;
    if (!*known) {
      std::cerr << "ckptctl: ls: no job '" << job << "' on the daemon at " << socket
                << " (`ckptctl jobs` lists the jobs you may see)\n";
      return kNotFound;
    }
  }
  if (json) {
    nlohmann::ordered_json doc = ToJson(r);
    doc["job"] = job;
    PrintJson(doc);
    return kOk;
  }
  std::printf("job %s: latest committed %" PRIu64 "\n", job.c_str(), r.latest());
  auto join = [](const auto& ranks) {
    std::string out;
    for (auto rk : ranks) out += (out.empty() ? "" : ",") + std::to_string(rk);
    return out.empty() ? std::string("-") : out;
  };
  const bool replication = r.replica_map().replicas() > 0;
  // With replication a last column: the replicas this node holds for others (memory ranks
  // are its own shards only).
  const char* row = replication ? "  %-11s %-11s %-16s %-16s %-16s %s\n" : "  %-11s %-11s %-16s %-16s %s%s\n";
  std::printf(row, "version", "state", "persistent ranks", "local ranks", "memory ranks",
              replication ? "replicas held here (for other nodes)" : "");
  for (const auto& v : r.versions()) {
    std::string held;  // "4,5 from 127.0.0.1:7001"
    std::map<std::string, std::vector<std::uint32_t>> by_origin;
    for (const auto& h : v.replicas_held()) by_origin[h.origin()].push_back(h.rank());
    for (const auto& [origin, ranks] : by_origin)
      held += (held.empty() ? "" : "; ") + join(ranks) + " from " + origin;
    const std::string name = "v" + std::to_string(v.version());
    std::printf(row, name.c_str(),
                v.committed()    ? "committed"
                : v.aborted()    ? "aborted"
                : v.restorable() ? "replicated"
                                 : "incomplete",
                join(v.durable_ranks()).c_str(), join(v.local_ranks()).c_str(),
                join(v.memory_ranks()).c_str(), replication ? (held.empty() ? "-" : held.c_str()) : "");
    if (v.aborted()) std::printf("      aborted: %s\n", v.abort_reason().c_str());
    if (v.under_replicated())
      std::printf("      under-replicated: %s\n", v.under_replicated_reason().c_str());
    for (const auto& h : v.replica_holders()) {
      std::string peers;
      for (const auto& p : h.peers()) peers += (peers.empty() ? "" : ", ") + p;
      std::printf("      rank %u's replicas: %s%s\n", h.rank(), peers.c_str(),
                  static_cast<std::uint32_t>(h.peers_size()) < r.replica_map().replicas()
                      ? (" (" + std::to_string(h.peers_size()) + " of " +
                         std::to_string(r.replica_map().replicas()) + ")")
                            .c_str()
                      : "");
    }
  }
  if (ask_peers && !replication) {
    std::printf("replicas: none to ask about (the daemon runs with --replicas 0)\n");
  }
  if (replication && !r.versions().empty()) {
    const auto& m = r.replica_map();
    std::printf("replicas of this node's shards: %s\n",
                m.source() == "acknowledged" ? "as the peers acknowledged them since this daemon started "
                                               "(--ask-peers: as they hold them now)"
                : m.source() == "listed"     ? "as the peers listed them just now"
                                             : "unknown: no peer could say which it holds");
    for (const auto& u : m.unanswered()) std::printf("  no answer from %s\n", u.c_str());
  }
  return kOk;
}

int Jobs(const std::string& socket, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 30);
  ckpt::v1::JobsReply r;
  grpc::Status s = stub->Jobs(&ctx, ckpt::v1::JobsRequest(), &r);
  if (!s.ok()) return Fail("jobs", s, socket);
  if (json) {
    PrintJson(ToJson(r));
    return kOk;
  }
  std::printf("%-24s %-28s %-10s %-9s %-10s %-11s %s\n", "job", "owner", "latest", "versions", "committed",
              "bytes", "sessions");
  for (const auto& j : r.jobs()) {
    std::string owner = j.has_owner() ? DescribeUid(j.owner_uid()) : std::string("(no owner file)");
    if (j.has_group()) owner += ", shared with " + DescribeGid(j.owner_gid());
    std::printf("%-24s %-28s %-10" PRIu64 " %-9u %-10u %-11s %u\n", j.job().c_str(), owner.c_str(),
                j.latest_committed(), j.versions(), j.committed_versions(), Human(j.bytes()).c_str(),
                j.sessions());
    if (!j.error().empty()) std::printf("  error: %s\n", j.error().c_str());
  }
  if (r.jobs().empty()) std::printf("(no jobs you may see)\n");
  return kOk;
}

int Prefetch(const std::string& socket, const std::string& job, std::uint64_t version,
             const std::vector<std::uint32_t>& ranks, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  ckpt::v1::PrefetchRequest req;
  req.set_job(job);
  req.set_version(version);
  for (auto r : ranks) req.add_ranks(r);
  ckpt::v1::PrefetchReply r;
  grpc::Status s = stub->Prefetch(&ctx, req, &r);
  if (!s.ok()) return Fail("prefetch", s, socket);
  if (json) {
    nlohmann::ordered_json doc = ToJson(r);
    doc["job"] = job;
    PrintJson(doc);
    return kOk;
  }
  std::printf("job %s version %" PRIu64 ": %u shard(s) copied to the local tier, %u into memory, %s read\n",
              job.c_str(), r.version(), r.local_shards(), r.memory_shards(), Human(r.bytes()).c_str());
  if (r.differential_shards() > 0) {
    std::printf("  %u differential shard(s) left on the persistent tier: restores read them and their base there\n",
                r.differential_shards());
  }
  return kOk;
}

int Finish(const std::string& socket, const std::string& job, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 60);
  ckpt::v1::FinishJobRequest req;
  req.set_job(job);
  ckpt::v1::FinishJobReply r;
  grpc::Status s = stub->FinishJob(&ctx, req, &r);
  if (!s.ok()) return Fail("finish", s, socket);
  if (json) {
    nlohmann::ordered_json doc = ToJson(r);
    doc["job"] = job;
    PrintJson(doc);
    return kOk;
  }
  std::printf(
      "job %s finished on this node: %u memory image(s) dropped (%s); %u of %u peer(s) dropped the "
      "replicas sent them\n",
      job.c_str(), r.memory_images_dropped(), Human(r.memory_bytes_dropped()).c_str(), r.peers_dropped(),
      r.peers_told());
  return kOk;
}

// The daemon's metrics, as GET /metrics serves them (docs/ops/metrics.md); --json wraps the
// text in {"text": ...}.
int Metrics(const std::string& socket, bool json) {
  auto stub = Connect(socket);
  grpc::ClientContext ctx;
  SetDeadline(ctx, 10);
  ckpt::v1::GetMetricsReply r;
  grpc::Status s = stub->GetMetrics(&ctx, ckpt::v1::GetMetricsRequest(), &r);
  if (!s.ok()) return Fail("metrics", s, socket);
  if (json) {
    PrintJson(ToJson(r));
    return kOk;
  }
  std::fputs(r.text().c_str(), stdout);
  return kOk;
}

}  // namespace ckptctl
