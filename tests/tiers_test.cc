// Tiers (memory, local, persistent) and commit across daemons, with real ckptd processes:
// several daemons on one machine, each with its own socket and local directory, sharing one
// persistent directory, stand for the nodes of a job.
#include <ckpt/client.h>
#include <signal.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/shard_path.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kTensors = 2;
constexpr std::size_t kTensorBytes = 1 << 20;

// The persistent tier of node `index`: DIR/persistent, or, with
// CKPT_TEST_SHARED_ROOTS=M0:M1:M2 (tests/ops/gluster_test.sh: three mounts of one
// distributed file system), the same directory seen through node index's own mount.
std::string SharedRoot(const TempDir& dir, int index) {
  const char* env = std::getenv("CKPT_TEST_SHARED_ROOTS");
  if (env == nullptr || *env == '\0') return dir.path() + "/persistent";
  std::vector<std::string> mounts;
  std::stringstream list(env);
  for (std::string m; std::getline(list, m, ':');) mounts.push_back(m);
  const std::string rel = "/" + fs::path(dir.path()).filename().string() + "/persistent";
  // Created through the first mount: the root must exist before a daemon serves it.
  fs::create_directories(mounts.front() + rel);
  return mounts[static_cast<std::size_t>(index) % mounts.size()] + rel;
}

// One simulated node: a daemon with its own socket and local tier, on the shared root.
struct Node {
  std::string local;
  DaemonOptions options;
  std::unique_ptr<DaemonProcess> daemon;

  // Not started: Start() it.
  Node(const TempDir& dir, int index, std::vector<std::string> extra = {}) {
    const std::string base = dir.path() + "/node" + std::to_string(index);
    local = base + "/local";
    options.root = SharedRoot(dir, index);
    options.socket = base + "/sock/ckptd.sock";
    options.extra_args = {"--local", local};
    options.extra_args.insert(options.extra_args.end(), extra.begin(), extra.end());
  }
  // Starts the daemon; with `pause` set, it stops at that point (see common/test_pause.h).
  void Start(const std::string& pause = "") {
    if (!pause.empty()) ::setenv("CKPTD_TEST_PAUSE", pause.c_str(), 1);
    daemon = std::make_unique<DaemonProcess>(options);
    ::unsetenv("CKPTD_TEST_PAUSE");
  }
  const std::string& socket() const { return options.socket; }
};

// One rank of the trainer: its state and its connection to its node's daemon.
struct Rank {
  std::uint32_t rank;
  TrainerState state;
  std::unique_ptr<Client> client;
  explicit Rank(std::uint32_t r, std::size_t tensors = kTensors)
      : rank(r), state(tensors, kTensorBytes, 100 + r) {}
  void Connect(const Node& node, const std::string& job, std::uint32_t world) {
    client = std::make_unique<Client>(Client::connect(node.socket()));
    client->register_items(job, rank, world, state.Items());
  }
  // Writes `version`'s content, snapshots it, and waits until it reaches `level`.
  void Save(std::uint64_t version, Level level = Level::kCommitted) {
    state.Fill(version);
    client->snapshot(version);
    client->wait_durable(version, level);
  }
};

bool Committed(const std::string& root, const std::string& job, std::uint64_t v) {
  return fs::exists(root + "/" + job + "/" + VersionDirName(v) + "/COMMITTED");
}

std::uint64_t LatestOnDisk(const std::string& root, const std::string& job) {
  std::string p = root + "/" + job + "/latest";
  return fs::exists(p) ? std::stoull(ReadFile(p)) : 0;
}

// The shard of `rank` at `version` verifies and holds what that rank's state held then.
void CheckShard(const std::string& path, std::uint32_t rank, std::uint64_t version) {
  INFO(path);
  REQUIRE(VerifyShard(path).ok());
  TrainerState expect(kTensors, kTensorBytes, 100 + rank);
  for (std::size_t t = 0; t < kTensors; ++t) {
    REQUIRE(ReadShardItem(path, "t" + std::to_string(t)) == expect.Expected(t, version));
  }
}

// `latest` names a version whose every shard loads and verifies.
void CheckLatestLoads(const std::string& root, const std::string& job, std::uint32_t world) {
  std::uint64_t latest = LatestOnDisk(root, job);
  if (latest == 0) return;
  REQUIRE(Committed(root, job, latest));
  for (std::uint32_t r = 0; r < world; ++r) CheckShard(ShardPath(root, job, latest, r), r, latest);
}

v1::ListReply List(const DaemonProcess& d, const std::string& job) {
  auto stub = d.Stub();
  grpc::ClientContext ctx;
  v1::ListRequest req;
  req.set_job(job);
  v1::ListReply out;
  REQUIRE(stub->List(&ctx, req, &out).ok());
  return out;
}

std::set<std::uint64_t> Versions(const v1::ListReply& list, const char* tier) {
  std::set<std::uint64_t> out;
  for (const auto& v : list.versions()) {
    int n = tier == std::string("persistent") ? v.durable_ranks_size()
            : tier == std::string("local")    ? v.local_ranks_size()
                                              : v.memory_ranks_size();
    if (n > 0) out.insert(v.version());
  }
  return out;
}

std::set<std::uint64_t> VersionDirs(const std::string& dir) {
  std::set<std::uint64_t> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (auto v = ParseVersionDirName(e.path().filename().string())) out.insert(*v);
  }
  return out;
}

// Snapshots `version` on every rank in `ranks` and waits until each is captured.
void SnapshotAll(std::vector<Rank>& ranks, std::uint64_t version) {
  for (auto& r : ranks) {
    r.state.Fill(version);
    r.client->snapshot(version);
  }
  for (auto& r : ranks) r.client->wait_snapshot(version);
}

}  // namespace

TEST_CASE("3 daemons x 2 ranks: a version commits once all 6 shards are durable", "[tiers][nodes]") {
  TempDir dir("nodes");
  std::vector<Node> nodes;
  for (int i = 0; i < 3; ++i) nodes.emplace_back(dir, i);
  for (auto& n : nodes) n.Start();
  const std::string root = nodes[0].options.root, job = "nodes";
  const std::uint32_t world = 6;
  std::vector<Rank> ranks;
  for (std::uint32_t r = 0; r < world; ++r) ranks.emplace_back(r);
  for (auto& r : ranks) r.Connect(nodes[r.rank / 2], job, world);

  for (std::uint64_t v = 1; v <= 4; ++v) {
    SnapshotAll(ranks, v);
    for (auto& r : ranks) {
      r.client->wait_durable(v, Level::kLocal);
      CheckLatestLoads(root, job, world);  // whatever moment it is read at
    }
    for (auto& r : ranks) r.client->wait_durable(v, Level::kCommitted);
    REQUIRE(LatestOnDisk(root, job) == v);
    CheckLatestLoads(root, job, world);
    // Each node's local tier holds its own ranks only.
    for (std::uint32_t r = 0; r < world; ++r) {
      CHECK(fs::exists(ShardPath(nodes[r / 2].local, job, v, r)));
      CHECK_FALSE(fs::exists(ShardPath(nodes[(r / 2 + 1) % 3].local, job, v, r)));
    }
  }
  // Five of six ranks durable on the persistent tier: no commit; the sixth completes it.
  for (std::uint32_t r = 0; r < 5; ++r) {
    ranks[r].Save(5, Level::kPersisted);
  }
  CHECK_FALSE(Committed(root, job, 5));
  CHECK(LatestOnDisk(root, job) == 4);
  ranks[5].state.Fill(5);
  ranks[5].client->snapshot(5);
  for (auto& r : ranks) r.client->wait_durable(5, Level::kCommitted);
  CHECK(LatestOnDisk(root, job) == 5);
  CheckLatestLoads(root, job, world);
  // Every node's daemon reports the commit (rank 0's daemon decided it).
  for (auto& n : nodes) CHECK(List(*n.daemon, job).latest() == 5);
}

TEST_CASE("kill -9 of one daemon mid-flush: that version never commits, the others keep serving",
          "[tiers][nodes][crash]") {
  TempDir dir("nodekill");
  std::vector<Node> nodes;
  for (int i = 0; i < 3; ++i) nodes.emplace_back(dir, i);
  const std::string root = nodes[0].options.root, job = "nodekill", pause = dir.path() + "/pause";
  const std::uint32_t world = 6;
  // Node 1 stops when a shard of version 3 is written but not yet published (and holds as
  // long as the file `pause` exists).
  { std::ofstream(pause) << "hold"; }
  nodes[0].Start();
  nodes[1].Start("publish:3:" + pause);
  nodes[2].Start();
  std::vector<Rank> ranks;
  for (std::uint32_t r = 0; r < world; ++r) ranks.emplace_back(r);
  for (auto& r : ranks) r.Connect(nodes[r.rank / 2], job, world);
  for (std::uint64_t v = 1; v <= 2; ++v) {
    SnapshotAll(ranks, v);
    for (auto& r : ranks) r.client->wait_durable(v, Level::kCommitted);
  }
  SnapshotAll(ranks, 3);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  nodes[1].daemon->Kill9();
  // The survivors' shards of version 3 become durable; the version does not commit.
  for (std::uint32_t r : {0u, 1u, 4u, 5u}) ranks[r].client->wait_durable(3, Level::kPersisted);
  CHECK_FALSE(Committed(root, job, 3));
  CHECK(LatestOnDisk(root, job) == 2);
  CheckLatestLoads(root, job, world);
  // The trainers of the dead daemon get an error saying so; the others are served.
  CHECK_THROWS_AS(ranks[2].client->snapshot(4), Error);
  CHECK(nodes[0].daemon->Status().pid() == nodes[0].daemon->pid());
  CHECK(nodes[2].daemon->Status().pid() == nodes[2].daemon->pid());

  // The daemon comes back; its trainers register again and training goes on.
  fs::remove(pause);
  nodes[1].Start();
  for (std::uint32_t r : {2u, 3u}) ranks[r].Connect(nodes[1], job, world);
  for (std::uint64_t v = 4; v <= 5; ++v) {
    SnapshotAll(ranks, v);
    for (auto& r : ranks) r.client->wait_durable(v, Level::kCommitted);
    REQUIRE(LatestOnDisk(root, job) == v);
    CheckLatestLoads(root, job, world);
  }
  CHECK_FALSE(Committed(root, job, 3));
  // The restarted daemon removed its half-written file; nothing of it is left anywhere.
  for (const auto& d : {nodes[1].local, root}) {
    for (const auto& f : ListFiles(d)) {
      INFO(f);
      CHECK(f.find(".tmp") == std::string::npos);
    }
  }
}

TEST_CASE("kill -9 of a trainer: its restart restores from daemon memory, reading no file",
          "[tiers][crash]") {
  TempDir dir("memrestore");
  Node node(dir, 0);
  node.Start();
  std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", node.socket(),  "--job", "mem", "--state-mib", "32",
      "--tensors",        "4",        "--compute-ms", "5"};
  auto args = base;
  args.insert(args.end(), {"--iters", "20", "--crash-at", "6"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(node.daemon->Status().bytes_read_total() == 0);
  args = base;
  args.insert(args.end(), {"--iters", "8", "--resume"});
  ProcessResult resumed = RunProcess(args);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  REQUIRE(resumed.output.find("restored version 6 from memory") != std::string::npos);
  REQUIRE(resumed.output.find("every byte verified") != std::string::npos);
  v1::StatusReply st = node.daemon->Status();
  CHECK(st.bytes_read_total() == 0);  // not one byte of a shard file read
  CHECK(st.restored_bytes_memory() == 32u << 20);
  CHECK(st.restored_bytes_local() == 0);
  CHECK(st.restored_bytes_persistent() == 0);
}

TEST_CASE("without its image in memory a restore reads the local tier, then the persistent one", "[tiers]") {
  TempDir dir("tierorder");
  Node node(dir, 0, {"--memory-mib", "0"});
  node.Start();
  Rank r0(0);
  r0.Connect(node, "order", 1);
  r0.Save(1);
  std::memset(r0.state.region()->data(), 0, r0.state.total_bytes());
  RestoreResult got = r0.client->restore();
  CHECK(got.tier == "local");
  CHECK(r0.state.FirstMismatch(1) == -1);
  fs::remove_all(node.local + "/order");
  std::memset(r0.state.region()->data(), 0, r0.state.total_bytes());
  got = r0.client->restore();
  CHECK(got.tier == "persistent");
  CHECK(r0.state.FirstMismatch(1) == -1);
  v1::StatusReply st = node.daemon->Status();
  CHECK(st.restored_bytes_local() == r0.state.total_bytes());
  CHECK(st.restored_bytes_persistent() == r0.state.total_bytes());
  CHECK(st.restored_bytes_memory() == 0);
}

TEST_CASE("kill -9 of a daemon during promotion: after its restart the promotion completes",
          "[tiers][crash]") {
  TempDir dir("promote");
  const std::string pause = dir.path() + "/pause";
  Node node(dir, 0);
  node.options.chunk_mib = 1;
  { std::ofstream(pause) << "hold"; }
  node.Start("promote:2:" + pause);
  const std::string root = node.options.root;
  // 8 MiB in 1 MiB pieces: the pause comes with half of it copied.
  Rank r0(0, 8);
  r0.Connect(node, "promo", 1);
  r0.Save(1);
  r0.Save(2, Level::kLocal);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  node.daemon->Kill9();
  bool half_copied = false;
  for (const auto& f : ListFiles(root)) half_copied |= f.find(".tmp") != std::string::npos;
  CHECK(half_copied);
  CHECK_FALSE(Committed(root, "promo", 2));

  fs::remove(pause);
  node.Start();
  // No trainer registers meanwhile: the restarted daemon finishes the promotion and the
  // commit on its own.
  REQUIRE(Eventually([&] { return List(*node.daemon, "promo").latest() == 2; }));
  const std::string shard = ShardPath(root, "promo", 2, 0);
  REQUIRE(VerifyShard(shard).ok());
  for (std::size_t t = 0; t < 8; ++t)
    REQUIRE(ReadShardItem(shard, "t" + std::to_string(t)) == r0.state.Expected(t, 2));
  for (const auto& f : ListFiles(root)) {
    INFO(f);
    CHECK(f.find(".tmp") == std::string::npos);
  }
}

TEST_CASE("retention: after 20 versions with K=2 and M=5 each tier holds what its rule says", "[tiers]") {
  TempDir dir("retain");
  Node node(dir, 0, {"--local-keep", "2", "--keep-last", "2", "--keep-every", "5", "--memory-versions", "2"});
  node.Start();
  Rank r0(0);
  r0.Connect(node, "ret", 1);
  for (std::uint64_t v = 1; v <= 20; ++v) {
    r0.Save(v);
  }
  const std::string root = node.options.root;
  CHECK(VersionDirs(root + "/ret") == std::set<std::uint64_t>{5, 10, 15, 19, 20});
  CHECK(VersionDirs(node.local + "/ret") == std::set<std::uint64_t>{19, 20});
  v1::ListReply list = List(*node.daemon, "ret");
  CHECK(Versions(list, "persistent") == std::set<std::uint64_t>{5, 10, 15, 19, 20});
  CHECK(Versions(list, "local") == std::set<std::uint64_t>{19, 20});
  CHECK(Versions(list, "memory") == std::set<std::uint64_t>{19, 20});
  for (std::uint64_t v : {5, 10, 15, 19, 20}) {
    INFO("version " << v);
    CHECK(Committed(root, "ret", v));
    CheckShard(ShardPath(root, "ret", v, 0), 0, v);
  }
  // An old version kept by the every-M-th rule restores from the persistent tier.
  RestoreResult got = r0.client->restore(10);
  CHECK(got.tier == "persistent");
  CHECK(r0.state.FirstMismatch(10) == -1);
}

TEST_CASE("prefetch pulls a committed version into a fresh node's local and memory tiers", "[tiers][nodes]") {
  TempDir dir("prefetch");
  Node writer(dir, 0);
  writer.Start();
  Rank r0(0), r1(1);
  r0.Connect(writer, "pf", 2);
  r1.Connect(writer, "pf", 2);
  std::vector<Rank*> both = {&r0, &r1};
  for (std::uint64_t v = 1; v <= 3; ++v) {
    for (Rank* r : both) {
      r->state.Fill(v);
      r->client->snapshot(v);
    }
    for (Rank* r : both) r->client->wait_durable(v);
  }
  r0.client.reset();
  r1.client.reset();
  writer.daemon->Stop();

  // The job restarts on a fresh node (an empty local tier, nothing in memory).
  Node fresh(dir, 1);
  fresh.Start();
  ProcessResult bad = RunProcess({CKPTCTL_BINARY, "--socket", fresh.socket(), "prefetch", "--job", "nope"});
  CHECK(bad.exit_code != 0);
  CHECK(bad.output.find("job 'nope' has no committed version") != std::string::npos);
  ProcessResult uncommitted =
      RunProcess({CKPTCTL_BINARY, "--socket", fresh.socket(), "prefetch", "--job", "pf", "--version", "9"});
  CHECK(uncommitted.exit_code != 0);
  CHECK(uncommitted.output.find("version 9 of job 'pf' is not committed") != std::string::npos);
  ProcessResult ok =
      RunProcess({CKPTCTL_BINARY, "--socket", fresh.socket(), "prefetch", "--job", "pf", "--ranks", "0,1"});
  INFO(ok.output);
  REQUIRE(ok.exit_code == 0);
  CHECK(ok.output.find("version 3: 2 shard(s) copied to the local tier, 2 into memory") != std::string::npos);
  CHECK(fs::exists(ShardPath(fresh.local, "pf", 3, 0)));
  CHECK(fs::exists(ShardPath(fresh.local, "pf", 3, 1)));
  const std::uint64_t read_by_prefetch = fresh.daemon->Status().bytes_read_total();
  for (Rank* r : both) {
    std::memset(r->state.region()->data(), 0, r->state.total_bytes());
    r->Connect(fresh, "pf", 2);
    RestoreResult got = r->client->restore();
    CHECK(got.version == 3);
    CHECK(got.tier == "memory");
    CHECK(r->state.FirstMismatch(3) == -1);
  }
  CHECK(fresh.daemon->Status().bytes_read_total() == read_by_prefetch);  // the restores read nothing
  // Prefetching again copies nothing.
  ProcessResult again = RunProcess({CKPTCTL_BINARY, "--socket", fresh.socket(), "prefetch", "--job", "pf"});
  CHECK(again.output.find("0 shard(s) copied to the local tier, 0 into memory") != std::string::npos);
}

TEST_CASE("ckptctl shows the tiers and the levels of each version", "[tiers][tools]") {
  TempDir dir("ctltiers");
  Node node(dir, 0);
  node.Start();
  Rank r0(0);
  r0.Connect(node, "show", 1);
  r0.Save(1);
  ProcessResult st = RunProcess({CKPTCTL_BINARY, "--socket", node.socket(), "status"});
  INFO(st.output);
  CHECK(st.exit_code == 0);
  CHECK(st.output.find("memory     held 2.0 MiB; in flight 0 B") != std::string::npos);
  CHECK(st.output.find("    job show             1 shard(s) 2.0 MiB") != std::string::npos);
  CHECK(st.output.find("local      " + node.local) != std::string::npos);
  CHECK(st.output.find("persistent " + node.options.root) != std::string::npos);
  ProcessResult ls = RunProcess({CKPTCTL_BINARY, "--socket", node.socket(), "ls", "--job", "show"});
  INFO(ls.output);
  CHECK(ls.output.find("v1          committed   0                0                0") != std::string::npos);
}

TEST_CASE(
    "the shipped config file starts a daemon with its tiers, and a local tier equal to the root is refused",
    "[tiers][config]") {
  TempDir dir("conf");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--config", CKPT_SOURCE_DIR "/deploy/ckptd.conf"};  // flags win over the file
  DaemonProcess daemon(o);
  v1::StatusReply st = daemon.Status();
  REQUIRE(st.tiers_size() == 2);  // the file sets no local tier
  CHECK(st.tiers(0).name() == "memory");
  CHECK(st.tiers(0).budget_bytes() == 4096ull << 20);
  CHECK(st.tiers(1).name() == "persistent");
  CHECK(st.tiers(1).dir() == o.root);
  CHECK(st.tiers(1).retention() == "last 3 committed versions");

  ProcessResult same = RunProcess(
      {CKPTD_BINARY, "--root", o.root, "--local", o.root, "--socket", dir.path() + "/sock2/ckptd.sock"});
  CHECK(same.exit_code == 2);
  CHECK(same.output.find("--local and --root are the same directory") != std::string::npos);
}
