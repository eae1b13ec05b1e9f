// The checkpoint contract, proven against a real ckptd process.
#include <ckpt/client.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/shard_path.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

DaemonOptions Options(const TempDir& dir, std::uint64_t pool_mib = 64, std::uint64_t chunk_mib = 4) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.pool_mib = pool_mib;
  o.chunk_mib = chunk_mib;
  return o;
}

const v1::ShardStatus* FindShard(const v1::StatusReply& s, const std::string& job, std::uint64_t v,
                                 std::uint32_t rank) {
  for (const auto& sh : s.shards()) {
    if (sh.job() == job && sh.version() == v && sh.rank() == rank) return &sh;
  }
  return nullptr;
}

// Checks every tensor of `state` in the shard against the content of `version`.
void CheckShardHolds(const std::string& path, const TrainerState& state, std::uint64_t version) {
  REQUIRE(VerifyShard(path).ok());
  for (std::size_t t = 0; t < state.tensors(); ++t) {
    INFO("tensor t" << t);
    REQUIRE(ReadShardItem(path, "t" + std::to_string(t)) == state.Expected(t, version));
  }
}

}  // namespace

TEST_CASE("snapshot returns while the copy is still in progress", "[contract]") {
  TempDir dir("lazy");
  // A pool much smaller than the state: capture cannot finish before ~1 GiB has been
  // written, so the state right after the call tells whether the call waited for copies.
  DaemonProcess daemon(Options(dir, 32, 4));
  TrainerState state(8, 128 << 20);  // 1 GiB
  state.Fill(1);
  Client client = Client::connect(daemon.socket());
  client.register_items("lazy", 0, 1, state.Items());

  client.snapshot(1);
  v1::StatusReply st = daemon.Status();
  const v1::ShardStatus* shard = FindShard(st, "lazy", 1, 0);
  REQUIRE(shard != nullptr);
  CHECK(shard->level() == v1::LEVEL_UNSPECIFIED);  // still copying
  CHECK(shard->copied_bytes() < shard->total_bytes());
  CHECK(shard->total_bytes() == state.total_bytes() + 0);

  client.wait_snapshot(1);
  client.wait_durable(1);
  CHECK(daemon.Status().shards(0).level() == v1::LEVEL_COMMITTED);
  REQUIRE(VerifyShard(ShardPath(daemon.root(), "lazy", 1, 0)).ok());
}

TEST_CASE("after wait_snapshot the trainer may overwrite everything, and the shard keeps the snapshot",
          "[contract]") {
  TempDir dir("mutate");
  DaemonProcess daemon(Options(dir, 16, 1));  // 64 MiB through 16 MiB: writes must recycle chunks
  TrainerState state(8, 8 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("mutate", 0, 1, state.Items());
  for (std::uint64_t v = 1; v <= 3; ++v) {
    state.Fill(v);
    client.snapshot(v, {{"step", std::to_string(v)}});
    client.wait_snapshot(v);
    // Overwrite every byte at once, as an optimizer step would, before the flush is done.
    std::memset(state.region()->data(), 0xAB, state.total_bytes());
  }
  client.wait_durable(3);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    INFO("version " << v);
    CheckShardHolds(ShardPath(daemon.root(), "mutate", v, 0), state, v);
    REQUIRE(ReadShardItem(ShardPath(daemon.root(), "mutate", v, 0), "step") == std::to_string(v));
  }
}

TEST_CASE("shards open with an independent safetensors reader", "[contract][format]") {
  TempDir dir("indep");
  DaemonProcess daemon(Options(dir));
  TrainerState state(5, 1 << 20);
  state.Fill(7);
  Client client = Client::connect(daemon.socket());
  client.register_items("indep", 0, 1, state.Items());
  client.snapshot(7, {{"rng", std::string("\x00\x01\x02state", 8)}, {"loader", "{\"epoch\": 3}"}});
  client.wait_durable(7);
  std::string shard = ShardPath(daemon.root(), "indep", 7, 0);
  std::string dump = dir.path() + "/dump";
  fs::create_directories(dump);
  ProcessResult r = RunProcess({"/usr/bin/env", "python3", CKPT_SOURCE_DIR "/tests/safetensors_spec_check.py",
                                "--dump-dir", dump, shard});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  for (std::size_t t = 0; t < state.tensors(); ++t) {
    REQUIRE(ReadFile(dump + "/t" + std::to_string(t) + ".bin") == state.Expected(t, 7));
  }
  REQUIRE(ReadFile(dump + "/__blob__%2Frng.bin") == std::string("\x00\x01\x02state", 8));
  REQUIRE(ReadFile(dump + "/__blob__%2Floader.bin") == "{\"epoch\": 3}");
}

TEST_CASE("a checkpoint larger than the pool goes through with bounded daemon memory", "[contract]") {
  TempDir dir("big");
  const std::uint64_t pool_mib = 256;
  DaemonOptions opts = Options(dir, pool_mib, 16);
  opts.extra_args = {"--memory-mib", "0"};  // the memory tier's own budget is tested in tiers_test
  DaemonProcess daemon(opts);
  TrainerState state(16, 128 << 20);  // 2 GiB
  state.Fill(1);
  Client client = Client::connect(daemon.socket());
  client.register_items("big", 0, 1, state.Items());
  client.snapshot(1);
  client.wait_snapshot(1);
  client.wait_durable(1);
  std::uint64_t peak = daemon.PeakRssBytes();
  INFO("daemon peak RSS " << (peak >> 20) << " MiB with a " << pool_mib << " MiB pool");
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  // A sanitizer's shadow memory (and ASan's quarantine of freed blocks) counts in the
  // daemon's RSS; the bound is for real builds.
  WARN("sanitizer build: RSS bound not checked (" << (peak >> 20) << " MiB)");
#else
  CHECK(peak < ((pool_mib + 100) << 20));
#endif
  std::string shard = ShardPath(daemon.root(), "big", 1, 0);
  REQUIRE(fs::file_size(shard) > state.total_bytes());
  CheckShardHolds(shard, state, 1);
}

TEST_CASE("kill -9 of the daemon mid-flush loses nothing committed", "[contract][crash]") {
  TempDir dir("kill");
  DaemonOptions opts = Options(dir, 16, 1);
  TrainerState state(4, 64 << 20);  // 256 MiB through a 16 MiB pool
  {
    DaemonProcess daemon(opts);
    Client client = Client::connect(daemon.socket());
    client.register_items("kill", 0, 1, state.Items());
    state.Fill(1);
    client.snapshot(1);
    client.wait_durable(1);
    state.Fill(2);
    client.snapshot(2);
    // Wait (by state, bounded) until version 2 is being written, then kill the daemon.
    bool writing = false;
    for (int i = 0; i < 20000 && !writing; ++i) {
      const v1::StatusReply st = daemon.Status();
      const v1::ShardStatus* sh = FindShard(st, "kill", 2, 0);
      writing = sh != nullptr && sh->written_bytes() > 0;
    }
    REQUIRE(writing);
    daemon.Kill9();
  }
  DaemonProcess daemon(opts);
  // No temporary leftovers after the restart.
  for (const auto& f : ListFiles(opts.root)) {
    INFO(f);
    CHECK(f.find(".tmp") == std::string::npos);
  }
  // Every version reported committed loads and verifies; latest is one of them.
  auto stub = daemon.Stub();
  grpc::ClientContext ctx;
  v1::ListRequest req;
  req.set_job("kill");
  v1::ListReply list;
  REQUIRE(stub->List(&ctx, req, &list).ok());
  REQUIRE(list.latest() >= 1);
  for (const auto& v : list.versions()) {
    if (!v.committed()) continue;
    INFO("committed version " << v.version());
    CheckShardHolds(ShardPath(opts.root, "kill", v.version(), 0), state, v.version());
  }
  // A restarted trainer restores the newest committed version byte for byte.
  std::memset(state.region()->data(), 0, state.total_bytes());
  Client client = Client::connect(daemon.socket());
  client.register_items("kill", 0, 1, state.Items());
  RestoreResult r = client.restore();
  REQUIRE(r.version == list.latest());
  REQUIRE(state.FirstMismatch(r.version) == -1);
  // And training continues: the next version commits.
  state.Fill(r.version + 1);
  client.snapshot(r.version + 1);
  client.wait_durable(r.version + 1);
  CheckShardHolds(ShardPath(opts.root, "kill", r.version + 1, 0), state, r.version + 1);
}

TEST_CASE("several ranks on one daemon: COMMITTED only once every rank is durable", "[contract]") {
  TempDir dir("ranks");
  DaemonProcess daemon(Options(dir));
  const std::uint32_t world = 3;
  std::vector<std::unique_ptr<TrainerState>> states;
  std::vector<Client> clients;
  for (std::uint32_t r = 0; r < world; ++r) {
    states.push_back(std::make_unique<TrainerState>(3, 1 << 20, 100 + r));
    states.back()->Fill(1);
    clients.push_back(Client::connect(daemon.socket()));
    clients.back().register_items("ranks", r, world, states.back()->Items());
  }
  std::string marker = daemon.root() + "/ranks/" + VersionDirName(1) + "/COMMITTED";
  for (std::uint32_t r = 0; r + 1 < world; ++r) {
    clients[r].snapshot(1);
    clients[r].wait_durable(1, Level::kDurable);
    INFO("after rank " << r << " is durable");
    CHECK(fs::exists(ShardPath(daemon.root(), "ranks", 1, r)));
    CHECK_FALSE(fs::exists(marker));
    CHECK_FALSE(fs::exists(daemon.root() + "/ranks/latest"));
  }
  clients[world - 1].snapshot(1);
  for (auto& c : clients) c.wait_durable(1, Level::kCommitted);
  REQUIRE(fs::exists(marker));
  REQUIRE(ReadFile(daemon.root() + "/ranks/latest") == "1\n");
  for (std::uint32_t r = 0; r < world; ++r) {
    INFO("rank " << r);
    CheckShardHolds(ShardPath(daemon.root(), "ranks", 1, r), *states[r], 1);
  }
}

TEST_CASE(
    "restore fills the regions byte-exact and returns the blobs, and rollback sets newer versions aside",
    "[contract]") {
  TempDir dir("restore");
  DaemonProcess daemon(Options(dir));
  TrainerState state(4, 2 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("restore", 0, 1, state.Items());
  for (std::uint64_t v = 1; v <= 4; ++v) {
    state.Fill(v);
    client.snapshot(v, {{"step", std::to_string(v)}});
    client.wait_durable(v);
  }
  std::memset(state.region()->data(), 0, state.total_bytes());
  RestoreResult latest = client.restore();
  REQUIRE(latest.version == 4);
  REQUIRE(state.FirstMismatch(4) == -1);
  REQUIRE(latest.blobs.size() == 1);
  REQUIRE(latest.blobs[0].data == "4");

  RestoreResult older = client.restore(2);
  REQUIRE(older.version == 2);
  REQUIRE(state.FirstMismatch(2) == -1);
  // Versions 3 and 4 were set aside, not deleted; numbering continues after 2.
  CHECK(fs::exists(daemon.root() + "/restore/set-aside/" + VersionDirName(4) + "/COMMITTED"));
  CHECK_FALSE(fs::exists(daemon.root() + "/restore/" + VersionDirName(3)));
  CHECK(ReadFile(daemon.root() + "/restore/latest") == "2\n");
  state.Fill(3);
  client.snapshot(3);
  client.wait_durable(3);
  CheckShardHolds(ShardPath(daemon.root(), "restore", 3, 0), state, 3);
}

TEST_CASE("a trainer killed with -9 restarts and resumes from the newest committed version",
          "[contract][crash]") {
  TempDir dir("toy");
  DaemonProcess daemon(Options(dir));
  std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "toy", "--state-mib", "32",
      "--tensors",        "4",        "--compute-ms",  "5"};
  auto args = base;
  args.insert(args.end(), {"--iters", "20", "--crash-at", "6"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  args = base;
  args.insert(args.end(), {"--iters", "9", "--resume"});
  ProcessResult resumed = RunProcess(args);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  // Version 6 was snapshotted just before the crash; the daemon finished it on its own.
  REQUIRE(resumed.output.find("restored version 6") != std::string::npos);
  REQUIRE(resumed.output.find("every byte verified") != std::string::npos);
  // The crashed trainer could not remove its shared memory; the daemon did, when the
  // restarted trainer took over its rank.
  const std::string marker = "in shared memory /";
  auto at = crashed.output.find(marker);
  REQUIRE(at != std::string::npos);
  std::string region = crashed.output.substr(at + marker.size());
  region = region.substr(0, region.find(';'));
  INFO("crashed trainer's region " << region);
  REQUIRE(region.rfind("ckpt-", 0) == 0);
  CHECK_FALSE(fs::exists("/dev/shm/" + region));
}

TEST_CASE("ckptctl status reports clients, shards and pool, as text and JSON", "[tools]") {
  TempDir dir("ctl");
  DaemonProcess daemon(Options(dir));
  TrainerState state(2, 1 << 20);
  state.Fill(1);
  Client client = Client::connect(daemon.socket());
  client.register_items("ctl", 0, 1, state.Items());
  client.snapshot(1);
  client.wait_durable(1);
  ProcessResult text = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status"});
  INFO(text.output);
  REQUIRE(text.exit_code == 0);
  CHECK(text.output.find("clients (1)") != std::string::npos);
  CHECK(text.output.find("committed") != std::string::npos);
  ProcessResult json = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status", "--json"});
  REQUIRE(json.exit_code == 0);
  auto doc = nlohmann::json::parse(json.output);
  CHECK(doc["clients"].size() == 1);
  CHECK(doc["clients"][0]["job"] == "ctl");
  CHECK(doc["pool_bytes"].get<std::uint64_t>() == 64ull << 20);  // a number (docs/ops/ckptctl.md)
  ProcessResult ls = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "ls", "--job", "ctl"});
  CHECK(ls.output.find("latest committed 1") != std::string::npos);
  std::string shard = ShardPath(daemon.root(), "ctl", 1, 0);
  ProcessResult verify = RunProcess({CKPTCTL_BINARY, "verify", shard});
  CHECK(verify.exit_code == 0);
  ProcessResult down = RunProcess({CKPTCTL_BINARY, "--socket", dir.path() + "/nope.sock", "status"});
  CHECK(down.exit_code == 1);
  CHECK(down.output.find("is ckptd running") != std::string::npos);
}

TEST_CASE("retention: keep-last deletes older committed versions after each commit", "[contract]") {
  TempDir dir("keep");
  DaemonOptions o = Options(dir);
  o.extra_args = {"--keep-last", "2"};
  DaemonProcess daemon(o);
  TrainerState state(2, 1 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("keep", 0, 1, state.Items());
  for (std::uint64_t v = 1; v <= 5; ++v) {
    state.Fill(v);
    client.snapshot(v);
    client.wait_durable(v);
  }
  std::vector<std::string> expect = {"keep/latest",
                                     "keep/owner",
                                     "keep/ranks/rank-00000",
                                     "keep/ranks/rank-00000.1.REG",
                                     "keep/v0000000004/COMMITTED",
                                     "keep/v0000000004/index.json",
                                     "keep/v0000000004/node-OWNER.1.done",
                                     "keep/v0000000004/rank-00000.safetensors",
                                     "keep/v0000000005/COMMITTED",
                                     "keep/v0000000005/index.json",
                                     "keep/v0000000005/node-OWNER.1.done",
                                     "keep/v0000000005/rank-00000.safetensors"};
  // The node marker and the registration's name hold ids of this run: spelt generically.
  std::vector<std::string> files = ListFiles(daemon.root());
  for (auto& f : files) {
    const std::string name = f.substr(f.find_last_of('/') + 1), dir = f.substr(0, f.size() - name.size());
    if (ParseNodeMarkerName(name)) f = dir + NodeMarkerName("OWNER", ParseNodeMarkerName(name)->ranks);
    if (auto id = ParseRegistrationName(name)) f = dir + RegistrationName(id->rank, id->generation, "REG");
  }
  REQUIRE(files == expect);
  std::memset(state.region()->data(), 0, state.total_bytes());
  REQUIRE(client.restore(4).version == 4);
  REQUIRE(state.FirstMismatch(4) == -1);
}

TEST_CASE("a shard left by an earlier run never completes a version of the new run", "[contract][crash]") {
  TempDir dir("stale");
  DaemonProcess daemon(Options(dir));
  TrainerState s0(2, 1 << 20, 10), s1(2, 1 << 20, 11);
  std::string marker = daemon.root() + "/stale/" + VersionDirName(2) + "/COMMITTED";
  {
    Client r0 = Client::connect(daemon.socket()), r1 = Client::connect(daemon.socket());
    r0.register_items("stale", 0, 2, s0.Items());
    r1.register_items("stale", 1, 2, s1.Items());
    s0.Fill(1);
    s1.Fill(1);
    r0.snapshot(1);
    r1.snapshot(1);
    r0.wait_durable(1);
    // Rank 0 gets version 2 to disk; rank 1 never does before the run ends.
    s0.Fill(2);
    r0.snapshot(2);
    r0.wait_durable(2, Level::kDurable);
  }
  REQUIRE(fs::exists(ShardPath(daemon.root(), "stale", 2, 0)));
  // The new run restores version 1 and computes version 2 anew, with other content.
  TrainerState n0(2, 1 << 20, 20), n1(2, 1 << 20, 21);
  Client r0 = Client::connect(daemon.socket()), r1 = Client::connect(daemon.socket());
  r0.register_items("stale", 0, 2, n0.Items());
  r1.register_items("stale", 1, 2, n1.Items());
  REQUIRE(r0.restore().version == 1);
  REQUIRE(r1.restore().version == 1);
  n1.Fill(2);
  r1.snapshot(2);
  r1.wait_durable(2, Level::kDurable);
  // Rank 0's old shard of version 2 is on disk, but it is not part of this run.
  CHECK_FALSE(fs::exists(marker));
  n0.Fill(2);
  r0.snapshot(2);
  r0.wait_durable(2);
  r1.wait_durable(2);
  REQUIRE(fs::exists(marker));
  CheckShardHolds(ShardPath(daemon.root(), "stale", 2, 0), n0, 2);
  CheckShardHolds(ShardPath(daemon.root(), "stale", 2, 1), n1, 2);
}
