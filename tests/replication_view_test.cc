// What an operator sees of peer replication: `ckptctl ls` (a node's own shards apart from the
// replicas it holds for others, and where its own ranks' replicas are), `ckptctl status` (per
// job whether the newest committed version is fully replicated, what each peer holds, the
// versions waiting for a rank, folded errors) and the metrics, with real ckptd processes on
// loopback TCP standing for the nodes (support/peer_cluster.h).
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "daemon/base/error_log.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/peer_cluster.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

constexpr std::uint64_t kRankBytes = kTensors * kTensorBytes;

std::string MetricsOf(const DaemonProcess& d) {
  auto stub = d.Stub();
  grpc::ClientContext ctx;
  v1::GetMetricsReply reply;
  REQUIRE(stub->GetMetrics(&ctx, v1::GetMetricsRequest(), &reply).ok());
  return reply.text();
}

const v1::VersionInfo* VersionOf(const v1::ListReply& list, std::uint64_t v) {
  for (const auto& info : list.versions()) {
    if (info.version() == v) return &info;
  }
  return nullptr;
}

std::vector<std::string> HoldersOf(const v1::VersionInfo& info, std::uint32_t rank) {
  for (const auto& h : info.replica_holders()) {
    if (h.rank() == rank) return {h.peers().begin(), h.peers().end()};
  }
  return {};
}

// The peer `address` as `st` shows it (an empty one if it is not listed).
v1::PeerStatus PeerIn(const v1::StatusReply& st, const std::string& address) {
  for (const auto& p : st.peers()) {
    if (p.address() == address) return p;
  }
  return v1::PeerStatus();
}

v1::ListReply ListAskingPeers(const DaemonProcess& d, const std::string& job) {
  auto stub = d.Stub();
  grpc::ClientContext ctx;
  v1::ListRequest req;
  req.set_job(job);
  req.set_ask_peers(true);
  v1::ListReply out;
  REQUIRE(stub->List(&ctx, req, &out).ok());
  return out;
}

}  // namespace

TEST_CASE("ls shows a node's own shards apart from the replicas it holds, and where its ranks' replicas are",
          "[replication][view]") {
  TempDir dir("rview-ls");
  Cluster c(dir, 3, 1);
  c.StartAll();
  Job job("rview-ls", 6);  // ranks 0-1 on node 0, 2-3 on node 1, 4-5 on node 2
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 2; ++v) job.Save(v);

  // Node 0 captured ranks 0 and 1 (their replicas are on node 1, the next by the peer rule)
  // and holds node 2's ranks 4 and 5 as replicas.
  const v1::ListReply list = c[0].List("rview-ls");
  CHECK(list.replica_map().replicas() == 1);
  CHECK(list.replica_map().source() == "acknowledged");
  const v1::VersionInfo* v2 = VersionOf(list, 2);
  REQUIRE(v2 != nullptr);
  CHECK(std::vector<std::uint32_t>(v2->memory_ranks().begin(), v2->memory_ranks().end()) ==
        std::vector<std::uint32_t>{0, 1});
  REQUIRE(v2->replicas_held_size() == 2);
  for (int i = 0; i < 2; ++i) {
    CHECK(v2->replicas_held(i).rank() == 4u + i);
    CHECK(v2->replicas_held(i).origin() == c.addresses[2]);
  }
  REQUIRE(v2->replica_holders_size() == 2);
  CHECK(HoldersOf(*v2, 0) == std::vector<std::string>{c.addresses[1]});
  CHECK(HoldersOf(*v2, 1) == std::vector<std::string>{c.addresses[1]});

  // What the acknowledgements say of the newest committed version is what the peers hold. (Of
  // an older one it may differ until the next commit: whether a holder's retention dropped it
  // depends on whether the holder saw the newer commit before or after the newer replica came.)
  const v1::ListReply asked = ListAskingPeers(c[0], "rview-ls");
  CHECK(asked.replica_map().source() == "listed");
  REQUIRE(asked.versions_size() == list.versions_size());
  for (int i = 0; i < list.versions_size(); ++i) {
    if (list.versions(i).version() < list.latest()) continue;
    INFO("version " << list.versions(i).version());
    for (std::uint32_t rank : {0u, 1u}) {
      CHECK(HoldersOf(list.versions(i), rank) == HoldersOf(asked.versions(i), rank));
    }
  }

  ProcessResult ls = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "ls", "--job", "rview-ls"});
  INFO(ls.output);
  REQUIRE(ls.exit_code == 0);
  CHECK_THAT(ls.output, Catch::Contains("replicas held here (for other nodes)") &&
                            Catch::Contains("4,5 from " + c.addresses[2]) &&
                            Catch::Contains("rank 0's replicas: " + c.addresses[1]) &&
                            Catch::Contains("as the peers acknowledged them since this daemon started"));
  ProcessResult json =
      RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "ls", "--job", "rview-ls", "--json"});
  INFO(json.output);
  REQUIRE(json.exit_code == 0);
  CHECK_THAT(json.output, Catch::Contains("\"replicas_held\"") && Catch::Contains("\"replica_holders\"") &&
                              Catch::Contains("\"source\": \"acknowledged\""));

  SECTION("after a restart of the origin the map is rebuilt from the peers") {
    c[0].Stop();
    c.Start(0);
    const v1::ListReply again = c[0].List("rview-ls");
    CHECK(again.replica_map().source() == "listed");
    CHECK(again.replica_map().unanswered_size() == 0);
    const v1::VersionInfo* v = VersionOf(again, 2);
    REQUIRE(v != nullptr);
    CHECK(HoldersOf(*v, 0) == std::vector<std::string>{c.addresses[1]});
    CHECK(HoldersOf(*v, 1) == std::vector<std::string>{c.addresses[1]});
    CHECK(v->replicas_held_size() == 0);  // its memory went with the restart
  }
  SECTION("--ask-peers lists what the peers hold now, and names a peer that cannot answer") {
    c[1].Kill9();
    const v1::ListReply asked = ListAskingPeers(c[0], "rview-ls");
    CHECK(asked.replica_map().source() == "listed");
    REQUIRE(asked.replica_map().unanswered_size() == 1);
    CHECK_THAT(asked.replica_map().unanswered(0), Catch::StartsWith(c.addresses[1] + ": "));
    const v1::VersionInfo* v = VersionOf(asked, 2);
    REQUIRE(v != nullptr);
    CHECK(HoldersOf(*v, 0).empty());  // its only holder is gone
  }
}

TEST_CASE("status shows per job whether the newest committed version is fully replicated",
          "[replication][view]") {
  TempDir dir("rview-full");
  Cluster c(dir, 2, 1);
  c.StartAll();
  Job job("rview-full", 2);  // both ranks on node 0, replicated to node 1
  job.Launch(c);
  job.Save(1);
  auto replication = [&] {
    v1::StatusReply st = c[0].Status();
    for (const auto& j : st.job_replication()) {
      if (j.job() == "rview-full") return j;
    }
    return v1::JobReplication();
  };
  v1::JobReplication r = replication();
  CHECK(r.version() == 1);
  CHECK(r.fully_replicated());
  REQUIRE(r.ranks_size() == 2);
  for (const auto& rank : r.ranks())
    CHECK(std::vector<std::string>(rank.peers().begin(), rank.peers().end()) ==
          std::vector<std::string>{c.addresses[1]});
  ProcessResult status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "status"});
  CHECK_THAT(status.output,
             Catch::Contains("job rview-full") && Catch::Contains("fully replicated: ranks 0-1"));

  // The only peer is gone: version 2 commits (the persistent tier is fine) but no peer holds it.
  c.Lose(1);
  for (auto& rk : job.ranks) {
    rk->state.Fill(2);
    rk->client->snapshot(2);
  }
  for (auto& rk : job.ranks) rk->client->wait_durable(2, Level::kCommitted);
  REQUIRE(Eventually([&] {
    r = replication();
    return r.version() == 2 && !r.fully_replicated() && r.missing_size() == 2;
  }));
  CHECK_THAT(r.missing(0), Catch::StartsWith("rank 0: held by 0 of 1 peers: "));
  status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "status"});
  INFO(status.output);
  CHECK_THAT(status.output, Catch::Contains("UNDER-REPLICATED: ranks 0-1") &&
                                Catch::Contains("rank 1: held by 0 of 1 peers"));
}

TEST_CASE("bytes restored from peers are counted in the metrics and the status line", "[replication][view]") {
  TempDir dir("rview-peer");
  Cluster c(dir, 3, 1);
  c.StartAll();
  Job job("rview-peer", 6);
  job.Launch(c);
  job.Save(1);
  c.Lose(2);
  c.Start(2);
  job.Launch(c);
  job.RestoreAll(1);
  const std::string metrics = MetricsOf(c[2]);
  INFO(metrics);
  CHECK_THAT(metrics, Catch::Contains("ckptd_bytes_restored_total{tier=\"peer\"} " +
                                      std::to_string(kRanksPerNode * kRankBytes) + "\n") &&
                          Catch::Contains("ckptd_bytes_restored_total{tier=\"persistent\"} 0\n"));
  ProcessResult status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(2), "status"});
  CHECK_THAT(status.output,
             Catch::Contains("restored: 0 B from memory, 0 B from local, 4.0 MiB from peer, 0 B from "
                             "persistent"));
}

TEST_CASE("every node of a job reports the same committed count, whichever daemon wrote COMMITTED",
          "[replication][view]") {
  TempDir dir("rview-count");
  Cluster c(dir, 3, 1);
  c.StartAll();
  Job job("rview-count", 6);
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 3; ++v) job.Save(v);
  for (int i = 0; i < 3; ++i) {
    INFO("node " << i);
    // A node that did not decide the commits sees them once its watcher reads COMMITTED.
    REQUIRE(Eventually([&] { return c[i].Status().versions_committed() == 3; }, std::chrono::seconds(10)));
    CHECK_THAT(MetricsOf(c[i]), Catch::Contains("ckptd_versions_committed_total{job=\"rview-count\"} 3\n"));
  }
}

TEST_CASE("a version that cannot commit because a node is gone names the missing ranks and their node",
          "[replication][view]") {
  TempDir dir("rview-stall");
  Cluster c(dir, 3, 1);
  c.StartAll();
  Job job("rview-stall", 6);
  job.Launch(c);
  job.Save(1);
  c.Lose(2);  // ranks 4 and 5 are gone with it
  for (auto& rk : job.ranks) {
    if (job.NodeOf(rk->rank) == 2) continue;
    rk->state.Fill(2);
    rk->client->snapshot(2);
  }
  for (auto& rk : job.ranks) {
    if (job.NodeOf(rk->rank) != 2) rk->client->wait_durable(2, Level::kPersisted);
  }
  // Within seconds (the report waits 5 s after the shard was persisted, then says so).
  v1::StalledVersion stalled;
  REQUIRE(Eventually(
      [&] {
        const v1::StatusReply st = c[1].Status();
        for (const auto& s : st.stalled_versions()) {
          if (s.job() == "rview-stall" && s.version() == 2) {
            stalled = s;
            return true;
          }
        }
        return false;
      },
      std::chrono::seconds(20)));
  CHECK(stalled.world_size() == 6);
  CHECK(std::vector<std::uint32_t>(stalled.missing_ranks().begin(), stalled.missing_ranks().end()) ==
        std::vector<std::uint32_t>{4, 5});
  REQUIRE(stalled.missing_nodes_size() == 1);
  CHECK_THAT(stalled.missing_nodes(0),
             Catch::StartsWith("rank(s) 4,5: node ") && Catch::Contains("wrote them in version 1"));
  ProcessResult status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "status"});
  INFO(status.output);
  CHECK_THAT(status.output,
             Catch::Contains("not committed (1)") &&
                 Catch::Contains("no shard of rank(s) 4-5 of 6 is durable (their node may be gone)"));
}

TEST_CASE("the error log folds identical messages into one entry with a count and when it was last seen",
          "[view]") {
  ErrorLog log;
  for (int i = 0; i < 5; ++i) log.Record("peer A unreachable; trying the next replica");
  log.Record("another error");
  log.Record("peer A unreachable; trying the next replica");
  const auto entries = log.Entries();
  REQUIRE(entries.size() == 2);
  CHECK(entries[0].message == "another error");
  CHECK(entries[0].count == 1);
  CHECK(entries[1].message == "peer A unreachable; trying the next replica");  // newest last
  CHECK(entries[1].count == 6);
  CHECK(entries[1].first <= entries[1].last);
  CHECK(log.Recent() ==
        std::vector<std::string>{"another error", "peer A unreachable; trying the next replica"});
  // Bounded by distinct messages.
  for (std::size_t i = 0; i < ErrorLog::kKept + 3; ++i) log.Record("error " + std::to_string(i));
  CHECK(log.Entries().size() == ErrorLog::kKept);
}

TEST_CASE("a restore that meets the same unreachable holder for each rank lists the error once, with a count",
          "[replication][view]") {
  TempDir dir("rview-fold");
  Cluster c(dir, 4, 1);
  c.StartAll();
  Job job("rview-fold", 8);
  job.Launch(c);
  job.Save(1);
  // Node 1 and its holder by the rule (node 2) are lost: node 1's ranks ask node 2 first and
  // fall back, once per rank and per restore. The same message each time is one entry.
  c.Lose(1);
  c.Lose(2);
  c.Start(1);
  c.Start(2);
  job.Launch(c);
  job.RestoreAll(1);
  job.RestoreAll(1);
  const v1::StatusReply st = c[1].Status();
  bool folded = false;
  for (const auto& e : st.error_entries()) {
    INFO(e.message());
    if (e.message().find("peer " + c.addresses[2] + " (a holder by the peer rule) holds no replica") !=
        std::string::npos) {
      CHECK(e.count() >= 2);
      CHECK(e.last_unix_ms() >= e.first_unix_ms());
      folded = folded || e.count() >= 2;
    }
  }
  CHECK(folded);
  // Each distinct message once in `errors`.
  std::vector<std::string> errors(st.errors().begin(), st.errors().end());
  std::sort(errors.begin(), errors.end());
  CHECK(std::adjacent_find(errors.begin(), errors.end()) == errors.end());
  ProcessResult status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(1), "status"});
  CHECK_THAT(status.output, Catch::Contains(" times, last "));
}

TEST_CASE(
    "the bytes a node holds for another and the bytes that node says are held agree after a job is finished",
    "[replication][view]") {
  TempDir dir("rview-held");
  Cluster c(dir, 2, 1);
  c.StartAll();
  // Two jobs whose ranks are all on node 0, replicated to node 1.
  Job ended("rview-held-a", 2), running("rview-held-b", 2);
  ended.Launch(c);
  running.Launch(c);
  ended.Save(1);
  running.Save(1);
  auto agree = [&](std::uint64_t* origin_says, std::uint64_t* holder_has) {
    const v1::PeerStatus said = PeerIn(c[0].Status(), c.addresses[1]);
    const v1::PeerStatus held = PeerIn(c[1].Status(), c.addresses[0]);
    *origin_says = said.sent_bytes_held();
    *holder_has = held.held_bytes();
    return said.sent_bytes_held_unix_ms() > 0 && *origin_says == *holder_has;
  };
  std::uint64_t says = 0, has = 0;
  REQUIRE(Eventually([&] { return agree(&says, &has); }, std::chrono::seconds(10)));
  CHECK(has >= 2 * 2 * kRankBytes);  // both jobs' two ranks

  // One job is finished on node 0: node 1 drops its replicas and keeps the other job's.
  for (auto& r : ended.ranks) r->client->unregister(/*job_finished=*/true);
  REQUIRE(Eventually([&] { return PeerIn(c[1].Status(), c.addresses[0]).held_bytes() < has; },
                     std::chrono::seconds(10)));
  const bool agreed = Eventually([&] { return agree(&says, &has); }, std::chrono::seconds(10));
  INFO("node 0 says node 1 holds " << says << " bytes of its shards; node 1 holds " << has);
  CHECK(agreed);
  CHECK(has >= 2 * kRankBytes);

  // A restarted origin does not know what its peers hold: it says so rather than 0.
  c[0].Stop();
  c.Start(0);
  const v1::PeerStatus said = PeerIn(c[0].Status(), c.addresses[1]);
  CHECK(said.address() == c.addresses[1]);
  CHECK(said.sent_bytes_held_unix_ms() == 0);
  ProcessResult status = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(0), "status"});
  CHECK_THAT(status.output,
             Catch::Contains("holds ? of this daemon's shards (it has not said since this daemon "
                             "started)"));
}
