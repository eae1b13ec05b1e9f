// The persist (promotion) queue under a persistent tier slower than checkpoints arrive, and
// a trainer's restart behind it, with real ckptd processes: a promotion held at the test
// pause point "promote" stands for slow storage. Superseded versions are skipped (their
// waits end with an error naming the newer version), the newest goes next, keep-every
// versions are kept, and a restart waits for its newest version only.
#include <ckpt/client.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kTensors = 2;
constexpr std::size_t kTensorBytes = 1 << 20;

// A daemon with a local tier whose promotion of version `held` (0: the first promotion to
// start) holds (half copied) while the file `pause` exists.
struct PausedNode {
  TempDir dir;
  std::string pause, local, root;
  std::unique_ptr<DaemonProcess> daemon;

  explicit PausedNode(const std::string& name, std::vector<std::string> extra = {}, int held = 1)
      : dir(name) {
    pause = dir.path() + "/pause";
    local = dir.path() + "/local";
    root = dir.path() + "/persistent";
    { std::ofstream(pause) << "hold"; }
    DaemonOptions o;
    o.root = root;
    o.socket = dir.path() + "/sock/ckptd.sock";
    o.extra_args = {"--local", local};
    o.extra_args.insert(o.extra_args.end(), extra.begin(), extra.end());
    o.env = {"CKPTD_TEST_PAUSE=promote:" + std::to_string(held) + ":" + pause};
    daemon = std::make_unique<DaemonProcess>(o);
  }
  // A test that failed while the promotion held must not leave the daemon's shutdown
  // waiting on it.
  ~PausedNode() { fs::remove(pause); }
  bool PromotionHeld() const { return fs::exists(pause + ".reached"); }
  void Release() { fs::remove(pause); }
  bool OnPersistent(const std::string& job, std::uint64_t v) const {
    return fs::exists(root + "/" + job + "/" + VersionDirName(v) + "/" + ShardFileName(0));
  }
  bool Committed(const std::string& job, std::uint64_t v) const {
    return fs::exists(root + "/" + job + "/" + VersionDirName(v) + "/COMMITTED");
  }
  bool OnLocal(const std::string& job, std::uint64_t v) const {
    return fs::exists(local + "/" + job + "/" + VersionDirName(v));
  }
};

struct Trainer {
  TrainerState state{kTensors, kTensorBytes, 7};
  std::unique_ptr<Client> client;
  Trainer(const DaemonProcess& d, const std::string& job, std::uint32_t world_size = 1) {
    client = std::make_unique<Client>(Client::connect(d.socket()));
    client->register_items(job, 0, world_size, state.Items());
  }
  // Snapshots `v` and waits until it is on the local tier (queued for promotion).
  void SnapshotToLocal(std::uint64_t v) {
    state.Fill(v);
    client->snapshot(v);
    client->wait_durable(v, Level::kLocal);
  }
  // The error that ends a wait for `v` at `level` (empty if it reaches it). Skipped versions
  // have failed already, so the wait ends at once; the timeout only bounds a broken daemon.
  std::string WaitError(std::uint64_t v, Level level) {
    try {
      client->wait_durable(v, level, std::chrono::seconds(5));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

std::string Superseded(std::uint64_t by) { return "superseded by version " + std::to_string(by); }

}  // namespace

TEST_CASE("persist queue: a version superseded before it is persisted is skipped, the newest goes next",
          "[tiers][queue]") {
  PausedNode node("pq-skip");
  const std::string job = "skip";
  Trainer t(*node.daemon, job);
  t.SnapshotToLocal(1);
  REQUIRE(Eventually([&] { return node.PromotionHeld(); }));
  // Versions 2..8 arrive while version 1 is being written: each supersedes the one queued
  // before it, so the queue never holds more than the one running and the newest.
  for (std::uint64_t v = 2; v <= 8; ++v) {
    t.SnapshotToLocal(v);
    CHECK(node.daemon->Status().promotions_pending() == 2);
  }
  for (std::uint64_t v = 2; v <= 7; ++v) {
    INFO("version " << v);
    const std::string persisted = t.WaitError(v, Level::kPersisted);
    CHECK(persisted.find("version " + std::to_string(v) + " of job 'skip'") != std::string::npos);
    CHECK(persisted.find(Superseded(v + 1) + " before it was persisted") != std::string::npos);
    CHECK(t.WaitError(v, Level::kCommitted).find(Superseded(v + 1)) != std::string::npos);
    // It was on the local tier: that level was reached and stays so.
    CHECK(t.WaitError(v, Level::kLocal).empty());
  }
  node.Release();
  CHECK(t.WaitError(8, Level::kCommitted).empty());
  CHECK(t.WaitError(1, Level::kCommitted).empty());
  for (std::uint64_t v = 2; v <= 7; ++v) {
    INFO("version " << v);
    CHECK_FALSE(node.OnPersistent(job, v));
    CHECK_FALSE(node.Committed(job, v));
  }
  // The skipped versions are unpinned: the local tier's retention removes them.
  REQUIRE(Eventually([&] {
    for (std::uint64_t v = 2; v <= 7; ++v) {
      if (node.OnLocal(job, v)) return false;
    }
    return true;
  }));
  // A skip is no failure of the run: the next snapshot goes on and commits.
  t.state.Fill(9);
  t.client->snapshot(9);
  CHECK(t.WaitError(9, Level::kCommitted).empty());
  CHECK(node.daemon->Status().promotions_pending() == 0);
}

TEST_CASE("persist queue: a keep-every version is skipped for no newer ordinary version", "[tiers][queue]") {
  PausedNode node("pq-keep", {"--keep-last", "2", "--keep-every", "3"});
  const std::string job = "keep";
  Trainer t(*node.daemon, job);
  t.SnapshotToLocal(1);
  REQUIRE(Eventually([&] { return node.PromotionHeld(); }));
  for (std::uint64_t v = 2; v <= 5; ++v) t.SnapshotToLocal(v);
  // 2 gave way to 3 and 4 to 5; 3, a multiple of keep_every, waits its turn behind 1.
  CHECK(t.WaitError(2, Level::kPersisted).find(Superseded(3)) != std::string::npos);
  CHECK(t.WaitError(4, Level::kPersisted).find(Superseded(5)) != std::string::npos);
  CHECK(node.daemon->Status().promotions_pending() == 3);
  node.Release();
  for (std::uint64_t v : {1, 3, 5}) {
    INFO("version " << v);
    CHECK(t.WaitError(v, Level::kCommitted).empty());
  }
  CHECK(node.Committed(job, 3));  // kept by the retention rule, as a multiple of 3
  CHECK_FALSE(node.OnPersistent(job, 2));
  CHECK_FALSE(node.OnPersistent(job, 4));
}

TEST_CASE("kill -9 of a trainer behind a slow promotion: its restart waits for its newest version only",
          "[tiers][queue][crash]") {
  // Which of versions 1 and 2 is promoted first depends on how fast the trainer runs.
  PausedNode node("pq-restart", {}, 0);
  const std::string job = "restart";
  std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", node.daemon->socket(), "--job", job, "--state-mib", "8",
      "--tensors",        "2",        "--compute-ms",        "5"};
  auto args = base;
  args.insert(args.end(), {"--iters", "10", "--crash-at", "3"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(Eventually([&] { return node.PromotionHeld(); }));
  // The restarted trainer registers while version 1 or 2 is still being promoted: the
  // running promotion is abandoned, since only version 3 (its newest) is what it will
  // restore.
  args = base;
  args.insert(args.end(), {"--iters", "4", "--resume"});
  const std::string out = node.dir.path() + "/resumed.log";
  const pid_t resumed = StartProcess(args, out);
  REQUIRE(Eventually(
      [&] { return node.daemon->Log().find("abandoning a running promotion") != std::string::npos; }));
  node.Release();
  int status = 0;
  REQUIRE(::waitpid(resumed, &status, 0) == resumed);
  const std::string output = ReadFile(out);
  INFO(output);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK(output.find("restored version 3 from memory") != std::string::npos);
  CHECK(node.Committed(job, 3));
  // Versions 1 and 2 were never written to the persistent tier (the running copy was
  // stopped and its temporary file removed) and never committed.
  for (std::uint64_t v : {1, 2}) {
    INFO("version " << v);
    CHECK_FALSE(node.Committed(job, v));
    CHECK_FALSE(node.OnPersistent(job, v));
  }
  for (const auto& e : fs::recursive_directory_iterator(node.root)) {
    INFO(e.path());
    CHECK(e.path().string().find(".tmp") == std::string::npos);
  }
  int said_why = 0;
  const v1::StatusReply st = node.daemon->Status();
  for (const auto& sh : st.shards()) {
    if (sh.job() != job || sh.version() > 2) continue;
    INFO(sh.error());
    CHECK(sh.error().find("superseded by version") != std::string::npos);
    CHECK(sh.error().find("before it was persisted") != std::string::npos);
    ++said_why;
  }
  CHECK(said_why == 2);
}

TEST_CASE(
    "with restart-waits none a restart restores the newest committed version at once, giving up those in "
    "flight",
    "[tiers][queue][crash]") {
  TempDir dir("pq-nowait");
  const std::string job = "nowait", pause = dir.path() + "/pause", out = dir.path() + "/resumed.log";
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--local", dir.path() + "/local", "--restart-waits", "none"};
  std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", o.socket,       "--job", job, "--state-mib", "8",
      "--tensors",        "2",        "--compute-ms", "5"};
  auto committed = [&](std::uint64_t v) {
    return fs::exists(o.root + "/" + job + "/" + VersionDirName(v) + "/COMMITTED");
  };
  // A first daemon commits version 1 (the run ends once it is committed).
  {
    DaemonProcess first(o);
    auto args = base;
    args.insert(args.end(), {"--iters", "1"});
    ProcessResult r = RunProcess(args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    REQUIRE(committed(1));
  }
  // The next daemon holds its first promotion: version 2 of a run killed right after it.
  { std::ofstream(pause) << "hold"; }
  struct Unpause {
    std::string path;
    ~Unpause() { fs::remove(path); }
  } unpause{pause};
  o.env = {"CKPTD_TEST_PAUSE=promote:0:" + pause};
  DaemonProcess daemon(o);
  auto args = base;
  args.insert(args.end(), {"--iters", "10", "--crash-at", "2", "--resume"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  // The restart restores version 1 while version 2's promotion is still held: it did not
  // wait for it (with --restart-waits newest it would wait for version 2 to commit).
  args = base;
  args.insert(args.end(), {"--iters", "4", "--resume"});
  const pid_t resumed = StartProcess(args, out);
  REQUIRE(Eventually([&] {
    const std::string log = daemon.Log();
    return log.find("restored version 1") != log.rfind("restored version 1");  // the second restore
  }));
  CHECK(fs::exists(pause));
  CHECK_FALSE(committed(2));
  fs::remove(pause);
  int status = 0;
  REQUIRE(::waitpid(resumed, &status, 0) == resumed);
  const std::string output = ReadFile(out);
  INFO(output);
  INFO(daemon.Log());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // From the local tier: the memory tier (one version here) holds version 2's image.
  CHECK(output.find("restored version 1 from local") != std::string::npos);
  // The crashed run's version 2 was given up, with its reason; the resumed run's own
  // versions 2 to 4 committed.
  CHECK(daemon.Log().find("rank 0 registered again (a restart or a restore) before it was") !=
        std::string::npos);
  CHECK(committed(4));
}

TEST_CASE("persist queue: a job with ranks on other daemons skips nothing (each daemon would skip others)",
          "[tiers][queue]") {
  // Rank 0 of 2 here, rank 1 on another node. Were versions skipped here on this daemon's
  // timing, the other daemon would skip different ones, and while trainers outpace storage
  // no version would have both ranks persisted: none would commit (seen on GlusterFS).
  PausedNode node("pq-spread");
  const std::string job = "spread";
  Trainer t(*node.daemon, job, 2);
  t.SnapshotToLocal(1);
  REQUIRE(Eventually([&] { return node.PromotionHeld(); }));
  for (std::uint64_t v = 2; v <= 5; ++v) t.SnapshotToLocal(v);
  node.Release();
  // Every version reaches the persistent tier, in order; none is skipped.
  for (std::uint64_t v = 1; v <= 5; ++v) {
    INFO("version " << v);
    CHECK(t.WaitError(v, Level::kPersisted).empty());
    CHECK(node.OnPersistent(job, v));
  }
  CHECK(node.daemon->Log().find("superseded by version") == std::string::npos);
}
