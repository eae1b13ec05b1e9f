// Warm start from peers (daemon/replication/warm_start.h): a replacement node's daemon pulls
// its ranks' shards back from peers' memory before the trainers register, with real ckptd
// processes on loopback TCP standing for the nodes (support/peer_cluster.h).
#include <ckpt/client.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/peer_cluster.h"
#include "support/run_as.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

// The newest warm start of `job` in a status reply; null if none.
const v1::WarmStartStatus* WarmOf(const v1::StatusReply& st, const std::string& job) {
  const v1::WarmStartStatus* found = nullptr;
  for (const auto& w : st.warm_starts()) {
    if (w.job() == job) found = &w;
  }
  return found;
}

bool Finished(const v1::WarmStartStatus* w) { return w != nullptr && (w->state() == "done" || w->state() == "failed"); }

std::vector<std::string> Ctl(const std::string& socket, std::vector<std::string> args) {
  std::vector<std::string> argv = {CKPTCTL_BINARY, "--socket", socket};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// Ranks with larger shards than support/peer_cluster.h's (2 x `tensor_mib` MiB), so that a
// transfer paced by --warm-start-mib-per-s takes several pieces of 4 MiB.
struct BigRank {
  std::uint32_t rank;
  TrainerState state;
  std::unique_ptr<Client> client;
  BigRank(std::uint32_t r, std::size_t tensor_mib) : rank(r), state(2, tensor_mib << 20, 100 + r) {}
  void Connect(const std::string& socket, const std::string& job, std::uint32_t world) {
    client = std::make_unique<Client>(Client::connect(socket));
    client->register_items(job, rank, world, state.Items());
  }
};

}  // namespace

TEST_CASE("a replacement node started with --warm-start restores its ranks from its own memory: no byte from a "
          "peer or a file at restore",
          "[warm_start]") {
  TempDir dir("warm1");
  Cluster c(dir, 3, 1);
  c.StartAll();
  Job job("warm1", 6);
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 2; ++v) job.Save(v);

  c.Lose(1);
  c.extra_args = {"--warm-start"};
  c.Start(1);  // the replacement: pulls ranks 2 and 3 of version 2 before any trainer registers
  REQUIRE(Eventually([&] { return Finished(WarmOf(c[1].Status(), "warm1")); }));
  auto before = c[1].Status();
  const v1::WarmStartStatus* w = WarmOf(before, "warm1");
  INFO(ErrorsOf(before));
  REQUIRE(w->state() == "done");
  CHECK(w->version() == 2);
  REQUIRE(w->shards_size() == 2);
  CHECK(w->shards(0).rank() == 2);
  CHECK(w->shards(1).rank() == 3);
  for (const auto& s : w->shards()) {
    CHECK(s.state() == "done");
    CHECK(s.peer() == c.addresses[2]);  // node 1's holder by the peer rule
    CHECK(s.bytes_done() == s.total_bytes());
  }
  CHECK(w->bytes_done() >= 2 * kTensors * kTensorBytes);
  const double fetched_before = Metric(c.socket(1), "ckptd_replication_bytes_total{direction=\"fetched\"}");
  CHECK(Metric(c.socket(1), "ckptd_warm_start_bytes_total") == static_cast<double>(w->bytes_done()));
  CHECK(Metric(c.socket(1), "ckptd_warm_start_shards{state=\"done\"}") == 2);
  CHECK(Metric(c.socket(1), "ckptd_warm_start_shards{state=\"failed\"}") == 0);
  // ckptctl status shows it.
  ProcessResult status = RunProcess(Ctl(c.socket(1), {"status"}));
  INFO(status.output);
  CHECK_THAT(status.output, Catch::Contains("warm starts from peers (1)") && Catch::Contains("job warm1") &&
                                Catch::Contains(" done "));

  job.Launch(c);
  auto tiers = job.RestoreAll(2);
  for (std::uint32_t r = 0; r < job.world; ++r) {
    INFO("rank " << r);
    CHECK(tiers[r] == "memory");
  }
  auto after = c[1].Status();
  CHECK(after.restored_bytes_memory() == 2 * kTensors * kTensorBytes);
  CHECK(after.restored_bytes_peer() == 0);
  CHECK(after.restored_bytes_persistent() == 0);
  CHECK(after.bytes_read_total() == 0);
  CHECK(Metric(c.socket(1), "ckptd_replication_bytes_total{direction=\"fetched\"}") == fetched_before);

  // Asked again, everything is held: nothing is queued, and it is done at once.
  ProcessResult again = RunProcess(Ctl(c.socket(1), {"prefetch", "--job", "warm1", "--from-peers", "--wait"}));
  INFO(again.output);
  CHECK(again.exit_code == 0);
  CHECK_THAT(again.output, Catch::Contains("0 shard(s)") && Catch::Contains("warm start done"));
  job.Save(3);  // training goes on
}

TEST_CASE("a peer killed in the middle of a warm start: the next peer serves, and the restore reads memory",
          "[warm_start]") {
  TempDir dir("warmkill");
  Cluster c(dir, 3, 2);
  c.StartAll();
  const std::string name = "warmkill";
  constexpr std::uint32_t kWorld = 6;
  constexpr std::size_t kTensorMib = 16;  // 32 MiB shards: 8 pieces
  std::vector<std::unique_ptr<BigRank>> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    ranks.push_back(std::make_unique<BigRank>(r, kTensorMib));
    ranks.back()->Connect(c.socket(static_cast<int>(r / kRanksPerNode)), name, kWorld);
  }
  for (auto& r : ranks) {
    r->state.Fill(1);
    r->client->snapshot(1);
  }
  for (auto& r : ranks) r->client->wait_durable(1, Level::kCommitted);
  for (auto& r : ranks) r->client->wait_durable(1, Level::kReplicated);

  // Node 0's shards are held by nodes 1 (first, by the rule) and 2.
  c.Lose(0);
  c.extra_args = {"--warm-start-mib-per-s", "8"};  // 4 s a shard: time to kill its peer
  c.Start(0);
  ProcessResult queued = RunProcess(Ctl(c.socket(0), {"prefetch", "--job", name, "--from-peers"}));
  INFO(queued.output);
  REQUIRE(queued.exit_code == 0);
  CHECK_THAT(queued.output, Catch::Contains("version 1: 2 shard(s)"));
  // Rank 0 is coming from node 1, a piece or more in and well short of the end: node 1 goes.
  const std::uint64_t shard_bytes = 2 * (kTensorMib << 20);
  REQUIRE(Eventually([&] {
    const v1::StatusReply now = c[0].Status();
    const v1::WarmStartStatus* w = WarmOf(now, name);
    if (w == nullptr || w->shards_size() == 0) return false;
    const auto& s = w->shards(0);
    return s.state() == "running" && s.peer() == c.addresses[1] && s.bytes_done() >= (4u << 20);
  }));
  {
    const v1::StatusReply now = c[0].Status();
    const v1::WarmStartStatus* w = WarmOf(now, name);
    REQUIRE(w->shards(0).bytes_done() < shard_bytes / 2);
  }
  c.Lose(1);
  REQUIRE(Eventually([&] { return Finished(WarmOf(c[0].Status(), name)); }));
  auto st = c[0].Status();
  const v1::WarmStartStatus* w = WarmOf(st, name);
  INFO(ErrorsOf(st));
  CHECK(w->state() == "done");
  for (const auto& s : w->shards()) {
    CHECK(s.state() == "done");
    CHECK(s.peer() == c.addresses[2]);
  }
  CHECK_THAT(ErrorsOf(st), Catch::Contains("warm start of job " + name + " version 1 rank 0: peer " + c.addresses[1]) &&
                               Catch::Contains("trying the next peer"));
  // The replacement trainers of node 0 restore from memory, byte-exact.
  for (std::uint32_t r : {0u, 1u}) {
    ranks[r] = std::make_unique<BigRank>(r, kTensorMib);
    ranks[r]->Connect(c.socket(0), name, kWorld);
    ranks[r]->state.Fill(999);
    RestoreResult got = ranks[r]->client->restore();
    INFO("rank " << r);
    CHECK(got.version == 1);
    CHECK(got.tier == "memory");
    CHECK(ranks[r]->state.FirstMismatch(1) == -1);
  }
  auto after = c[0].Status();
  CHECK(after.restored_bytes_peer() == 0);
  CHECK(after.bytes_read_total() == 0);
}

TEST_CASE("a warm start whose only holder goes away fails, says why, and the restore reads the persistent tier",
          "[warm_start]") {
  TempDir dir("warmgone");
  Cluster c(dir, 2, 1);
  c.StartAll();
  const std::string name = "warmgone";
  std::vector<std::unique_ptr<BigRank>> ranks;
  for (std::uint32_t r = 0; r < 4; ++r) {
    ranks.push_back(std::make_unique<BigRank>(r, 16));
    ranks.back()->Connect(c.socket(static_cast<int>(r / kRanksPerNode)), name, 4);
  }
  for (auto& r : ranks) {
    r->state.Fill(1);
    r->client->snapshot(1);
  }
  for (auto& r : ranks) r->client->wait_durable(1, Level::kCommitted);
  for (auto& r : ranks) r->client->wait_durable(1, Level::kReplicated);
  c.Lose(0);
  c.extra_args = {"--warm-start-mib-per-s", "8"};
  c.Start(0);
  REQUIRE(RunProcess(Ctl(c.socket(0), {"prefetch", "--job", name, "--from-peers"})).exit_code == 0);
  REQUIRE(Eventually([&] {
    const v1::StatusReply now = c[0].Status();
    const v1::WarmStartStatus* w = WarmOf(now, name);
    return w != nullptr && w->shards_size() > 0 && w->shards(0).state() == "running" &&
           w->shards(0).bytes_done() >= (4u << 20);
  }));
  c.Lose(1);
  REQUIRE(Eventually([&] { return Finished(WarmOf(c[0].Status(), name)); }));
  auto st = c[0].Status();
  const v1::WarmStartStatus* w = WarmOf(st, name);
  CHECK(w->state() == "failed");
  CHECK_THAT(w->error(), Catch::Contains("2 of 2 shard(s) not pulled (their restore reads the next source)"));
  for (const auto& s : w->shards()) {
    CHECK(s.state() == "failed");
    CHECK(s.bytes_done() == 0);  // nothing of a partial transfer counts
  }
  CHECK(st.tiers(0).shards() == 0);  // no partial image is held
  ProcessResult waited = RunProcess(Ctl(c.socket(0), {"prefetch", "--job", name, "--from-peers", "--wait"}));
  INFO(waited.output);
  CHECK(waited.exit_code != 0);
  for (std::uint32_t r : {0u, 1u}) {
    ranks[r] = std::make_unique<BigRank>(r, 16);
    ranks[r]->Connect(c.socket(0), name, 4);
    ranks[r]->state.Fill(999);
    RestoreResult got = ranks[r]->client->restore();
    CHECK(got.version == 1);
    CHECK(got.tier == "persistent");
    CHECK(ranks[r]->state.FirstMismatch(1) == -1);
  }
}

TEST_CASE("a replacement with another secret: the peers refuse the warm start, it says so, and the restore reads "
          "the persistent tier",
          "[warm_start]") {
  TempDir dir("warmsecret");
  Cluster c(dir, 2, 1);
  c.StartAll();
  Job job("warmsecret", 4);
  job.Launch(c);
  job.Save(1);
  c.Lose(0);
  const std::string other = WriteSecret(dir.path() + "/other-secret", "not the secret of this cluster");
  c.extra_args = {"--warm-start"};
  c.daemons[0] = std::make_unique<DaemonProcess>(c.Options(0, other));
  // At start: said in the error log, naming the peer and the secret.
  REQUIRE(Eventually([&] {
    return ErrorsOf(c[0].Status()).find("warm start of job 'warmsecret'") != std::string::npos;
  }));
  const std::string errors = ErrorsOf(c[0].Status());
  INFO(errors);
  CHECK_THAT(errors, Catch::Contains("could not say") && Catch::Contains(c.addresses[1]) &&
                         Catch::Contains("--peer-secret"));
  // Asked for: refused with the same reason.
  ProcessResult asked = RunProcess(Ctl(c.socket(0), {"prefetch", "--job", "warmsecret", "--from-peers"}));
  INFO(asked.output);
  CHECK(asked.exit_code == 1);
  CHECK_THAT(asked.output, Catch::Contains("could not say") && Catch::Contains("--peer-secret"));
  CHECK(c[0].Status().tiers(0).shards() == 0);
  job.Launch(c);
  auto tiers = job.RestoreAll(1);
  CHECK(tiers[0] == "persistent");
  CHECK(tiers[1] == "persistent");
}

TEST_CASE("prefetch --from-peers: a job the caller does not own is refused, and without replication it says why",
          "[warm_start]") {
  if (::geteuid() != 0) {
    WARN("needs root to act as another uid; skipped");
    return;
  }
  constexpr uid_t kOther = 65533;
  TempDir dir("warmown");
  fs::create_directories(dir.path() + "/sock");
  ::chmod(dir.path().c_str(), 0755);
  ::chmod((dir.path() + "/sock").c_str(), 0755);
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--socket-mode", "0666", "--allow-uid", std::to_string(kOther)};
  DaemonProcess d(o);
  TrainerState state(1, 1 << 20);
  {
    Client client = Client::connect(d.socket());
    client.register_items("warmown", 0, 1, state.Items());  // the job is root's now
  }
  ProcessResult other = RunAs(kOther, Ctl(d.socket(), {"prefetch", "--job", "warmown", "--from-peers"}));
  INFO(other.output);
  CHECK(other.exit_code == 1);
  CHECK_THAT(other.output, Catch::Contains("PERMISSION_DENIED") &&
                               Catch::Contains("job 'warmown' belongs to uid 0") &&
                               Catch::Contains("uid " + std::to_string(kOther) + " may not warm-start it"));
  ProcessResult mine = RunProcess(Ctl(d.socket(), {"prefetch", "--job", "warmown", "--from-peers"}));
  INFO(mine.output);
  CHECK(mine.exit_code == 1);
  CHECK_THAT(mine.output, Catch::Contains("does not replicate (--replicas 0)"));
  // Naming ranks is root's (it pulls whatever any peer holds, into memory other jobs use);
  // the job's owner warm-starts the ranks sent from this node.
  REQUIRE(RunAs(kOther, ToyTrainerArgs(d.socket(), "warmtheirs", 1, false)).exit_code == 0);
  ProcessResult named = RunAs(kOther, Ctl(d.socket(), {"prefetch", "--job", "warmtheirs", "--from-peers",
                                                       "--ranks", "0"}));
  INFO(named.output);
  CHECK(named.exit_code == 1);
  CHECK_THAT(named.output, Catch::Contains("PERMISSION_DENIED") &&
                               Catch::Contains("naming the ranks of a warm start (--ranks) is for root"));
  std::string many;
  for (int r = 0; r <= 4096; ++r) many += (r ? "," : "") + std::to_string(r);
  ProcessResult too_many = RunProcess(Ctl(d.socket(), {"prefetch", "--job", "warmown", "--from-peers", "--ranks", many}));
  INFO(too_many.output);
  CHECK(too_many.exit_code == 2);  // an argument the daemon refuses as invalid
  CHECK_THAT(too_many.output, Catch::Contains("INVALID_ARGUMENT") && Catch::Contains("at most 4096 in one call"));
  // --wait needs --from-peers; --version does not go with it.
  CHECK(RunProcess(Ctl(d.socket(), {"prefetch", "--job", "warmown", "--wait"})).exit_code == 2);
  CHECK(RunProcess(Ctl(d.socket(), {"prefetch", "--job", "warmown", "--from-peers", "--version", "1"})).exit_code ==
        2);
  // --warm-start without replication does not start.
  ProcessResult flag = RunProcess({CKPTD_BINARY, "--socket", dir.path() + "/x.sock", "--root", o.root, "--warm-start",
                                   "--check-config"});
  CHECK(flag.exit_code == 2);
  CHECK_THAT(flag.output, Catch::Contains("--warm-start needs --replicas"));
  ProcessResult cap = RunProcess({CKPTD_BINARY, "--socket", dir.path() + "/x.sock", "--root", o.root,
                                  "--warm-start-mib-per-s", "2000000", "--check-config"});
  CHECK(cap.exit_code == 2);
  CHECK_THAT(cap.output, Catch::Contains("--warm-start-mib-per-s"));
}
