// A trainer survives a daemon restart (issue 12): real ckptd processes killed with SIGKILL
// at a deterministic point (the CKPTD_TEST_PAUSE seam, common/test_pause.h) under a running
// trainer, and a new daemon started on the same socket and root. libckpt must notice,
// register the same regions again, fail the versions in flight with an error naming them,
// and take later snapshots, which commit and resume byte-exact.
#include <ckpt/client.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
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

DaemonOptions Options(const TempDir& dir) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  return o;
}

// A daemon that stops at `point` of `version` (see common/test_pause.h) until the returned
// path is removed; `PATH.reached` appears when it got there.
std::unique_ptr<DaemonProcess> StartPaused(const DaemonOptions& o, const std::string& point,
                                           std::uint64_t version, const std::string& pause) {
  std::ofstream(pause).put('x');
  ::setenv("CKPTD_TEST_PAUSE", (point + ":" + std::to_string(version) + ":" + pause).c_str(), 1);
  auto d = std::make_unique<DaemonProcess>(o);
  ::unsetenv("CKPTD_TEST_PAUSE");
  return d;
}

bool Committed(const std::string& root, const std::string& job, std::uint64_t v) {
  return fs::exists(root + "/" + job + "/" + VersionDirName(v) + "/COMMITTED");
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The numbers after `prefix` on each line of `text` that starts with it.
std::set<std::uint64_t> Numbers(const std::string& text, const std::string& prefix) {
  std::set<std::uint64_t> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    std::istringstream nums(line.substr(prefix.size()));
    std::uint64_t v;
    while (nums >> v) out.insert(v);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "a toy trainer goes on through a kill -9 and restart of its daemon, later versions commit and resume",
    "[restart]") {
  TempDir dir("restart-toy");
  const DaemonOptions o = Options(dir);
  const std::string pause = dir.path() + "/pause";
  // The daemon stops before copying anything of version 5: it is in flight, not captured.
  auto daemon = StartPaused(o, "capture", 5, pause);
  const std::string log = dir.path() + "/trainer.log";
  const pid_t trainer = StartProcess(
      {TOY_TRAINER_BINARY, "--socket", o.socket, "--job", "toy", "--state-mib", "8", "--tensors", "4",
       "--iters", "12", "--compute-ms", "20", "--keep-going", "--reconnect-budget-s", "120"},
      log);
  // The kill comes once the trainer's snapshot(5) returned (else the client would simply
  // take version 5 again from the new daemon) and the daemon holds version 5 uncopied.
  REQUIRE(Eventually([&] { return Slurp(log).find("snapshot taken: 5\n") != std::string::npos; }));
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  daemon->Kill9();
  daemon = std::make_unique<DaemonProcess>(o);  // systemd's Restart=on-failure, no pause now
  const int rc = WaitProcess(trainer);
  const std::string out = Slurp(log);
  INFO(out);
  INFO(daemon->Log());
  REQUIRE(rc == 0);
  CHECK(out.find("daemon restarted; version 5 was not captured") != std::string::npos);
  CHECK(out.find("re-registered job toy rank 0/1") != std::string::npos);
  const std::set<std::uint64_t> taken = Numbers(out, "snapshot taken:");
  const std::set<std::uint64_t> lost = Numbers(out, "lost versions:");
  CHECK(lost.count(5) == 1);
  // Training went on: every version after the restart was taken and commits.
  for (std::uint64_t v = 6; v <= 12; ++v) {
    INFO("version " << v);
    CHECK(taken.count(v) == 1);
    CHECK(lost.count(v) == 0);
    CHECK(Eventually([&] { return Committed(o.root, "toy", v); }));
  }
  // Nothing vanished silently: a version taken before the restart committed or was reported.
  for (std::uint64_t v : taken) {
    INFO("version " << v);
    CHECK((Committed(o.root, "toy", v) || lost.count(v) == 1));
  }
  CHECK_FALSE(Committed(o.root, "toy", 5));
  ProcessResult ls = RunProcess({CKPTCTL_BINARY, "--socket", o.socket, "ls", "--job", "toy"});
  INFO(ls.output);
  CHECK(ls.output.find("latest committed 12") != std::string::npos);
  // A new trainer process resumes from the newest version, every byte checked.
  ProcessResult resume = RunProcess({TOY_TRAINER_BINARY, "--socket", o.socket, "--job", "toy", "--state-mib",
                                     "8", "--tensors", "4", "--iters", "12", "--resume"});
  INFO(resume.output);
  CHECK(resume.exit_code == 0);
  CHECK(resume.output.find("restored version 12") != std::string::npos);
  CHECK(resume.output.find("every byte verified") != std::string::npos);
}

TEST_CASE("a daemon that stays down longer than the reconnect budget fails the call with a clear error",
          "[restart]") {
  TempDir dir("restart-down");
  const DaemonOptions o = Options(dir);
  const std::string pause = dir.path() + "/pause";
  auto daemon = StartPaused(o, "capture", 3, pause);
  const std::string log = dir.path() + "/trainer.log";
  const pid_t trainer =
      StartProcess({TOY_TRAINER_BINARY, "--socket", o.socket, "--job", "down", "--state-mib", "1",
                    "--tensors", "1", "--iters", "6", "--compute-ms", "20", "--reconnect-budget-s", "1.5"},
                   log);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  const auto killed = std::chrono::steady_clock::now();
  daemon->Kill9();  // and not started again
  const int rc = WaitProcess(trainer);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string out = Slurp(log);
  INFO(out);
  CHECK(rc == 2);
  CHECK(out.find("ckptd at " + o.socket + " did not come back within 1.5 s") != std::string::npos);
  // Version 3 was in flight (1 and 2 may be too, if they had not committed yet).
  CHECK(out.find("versions not known committed then: ") != std::string::npos);
  CHECK(out.find("3; the next call tries again") != std::string::npos);
  CHECK(waited >= 1.5);
  CHECK(waited < 30);
}

TEST_CASE(
    "versions in flight at a restart fail by name, earlier committed ones still answer, later ones commit",
    "[restart]") {
  TempDir dir("restart-lost");
  const DaemonOptions o = Options(dir);
  const std::string pause = dir.path() + "/pause";
  auto daemon = StartPaused(o, "capture", 3, pause);
  TrainerState state(2, 1 << 20, 7);
  ClientOptions options;
  options.reconnect_budget = std::chrono::seconds(60);
  Client client = Client::connect(o.socket, options);
  client.register_items("lost", 0, 1, state.Items());
  state.Fill(1);
  client.snapshot(1);
  client.wait_durable(1);
  state.Fill(2);
  client.snapshot(2);
  client.wait_snapshot(2);
  state.Fill(3);
  client.snapshot(3);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  daemon->Kill9();
  daemon = std::make_unique<DaemonProcess>(o);

  // Committed before the restart: still answers.
  CHECK_NOTHROW(client.wait_durable(1));
  CHECK_NOTHROW(client.wait_snapshot(1));
  // Version 3 was never copied: its wait fails at once, naming it (and 2 if that one did
  // not commit in time).
  const bool two_committed = Committed(o.root, "lost", 2);
  try {
    client.wait_snapshot(3);
    FAIL("wait_snapshot(3) returned although version 3 was never captured");
  } catch (const DaemonRestartedError& e) {
    INFO(e.what());
    CHECK(e.code() == DaemonRestartedError::kAborted);
    CHECK(std::string(e.what()).find("daemon restarted; version 3 was not captured") != std::string::npos);
    CHECK(std::count(e.versions().begin(), e.versions().end(), 3) == 1);
    CHECK(std::count(e.versions().begin(), e.versions().end(), 2) == (two_committed ? 0 : 1));
  }
  // Asked again, the answer is the same; it never blocks.
  CHECK_THROWS_AS(client.wait_durable(3), DaemonRestartedError);
  // Version 2 was captured before the crash.
  CHECK_NOTHROW(client.wait_snapshot(2));
  if (two_committed) {
    CHECK_NOTHROW(client.wait_durable(2));
  } else {
    CHECK_THROWS_WITH(client.wait_durable(2), Catch::Contains("daemon restarted; version 2 was not"));
  }
  // Everything was reported: the next snapshot is taken and commits.
  state.Fill(4);
  client.snapshot(4);
  client.wait_durable(4);
  CHECK(Committed(o.root, "lost", 4));
  CHECK_FALSE(Committed(o.root, "lost", 3));
  client.unregister();

  TrainerState fresh(2, 1 << 20, 7);
  Client reader = Client::connect(o.socket);
  reader.register_items("lost", 0, 1, fresh.Items());
  RestoreResult r = reader.restore();
  CHECK(r.version == 4);
  CHECK(fresh.FirstMismatch(4) == -1);
}

TEST_CASE("a version lost while the trainer was between calls is reported by the next snapshot, once",
          "[restart]") {
  TempDir dir("restart-idle");
  const DaemonOptions o = Options(dir);
  const std::string pause = dir.path() + "/pause";
  // Version 2 is captured and written to its .tmp file, but not published.
  auto daemon = StartPaused(o, "publish", 2, pause);
  TrainerState state(2, 1 << 20, 9);
  Client client = Client::connect(o.socket);
  client.register_items("idle", 0, 1, state.Items());
  state.Fill(1);
  client.snapshot(1);
  client.wait_durable(1);
  state.Fill(2);
  client.snapshot(2);
  client.wait_snapshot(2);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  daemon->Kill9();
  daemon = std::make_unique<DaemonProcess>(o);

  state.Fill(3);
  try {
    client.snapshot(3);
    FAIL("snapshot(3) did not report version 2, lost to the restart");
  } catch (const DaemonRestartedError& e) {
    INFO(e.what());
    const std::string msg = e.what();
    CHECK(msg.find("daemon restarted; version 2 was not made durable") != std::string::npos);
    CHECK(msg.find("newest committed version: 1") != std::string::npos);
    CHECK(msg.find("this snapshot of version 3 was not taken") != std::string::npos);
    CHECK(e.versions() == std::vector<std::uint64_t>{2});
  }
  client.snapshot(3);  // reported once: this one is taken
  client.wait_durable(3);
  CHECK(Committed(o.root, "idle", 3));
  CHECK_FALSE(Committed(o.root, "idle", 2));
  CHECK_THROWS_WITH(client.wait_durable(2),
                    Catch::Contains("daemon restarted; version 2 was not made durable"));
  // A restore goes to the new daemon too, into the same regions.
  state.Fill(99);
  RestoreResult r = client.restore();
  CHECK(r.version == 3);
  CHECK(state.FirstMismatch(3) == -1);
}

TEST_CASE("with a reconnect budget of 0, a call that finds its daemon gone fails at once", "[restart]") {
  TempDir dir("restart-off");
  const DaemonOptions o = Options(dir);
  auto daemon = std::make_unique<DaemonProcess>(o);
  TrainerState state(1, 1 << 20);
  ClientOptions options;
  options.reconnect_budget = std::chrono::milliseconds(0);
  Client client = Client::connect(o.socket, options);
  client.register_items("off", 0, 1, state.Items());
  state.Fill(1);
  client.snapshot(1);
  client.wait_durable(1);
  daemon->Kill9();
  state.Fill(2);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(client.snapshot(2), Catch::Contains("is not back, and the reconnect budget is 0"));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  // The daemon is back: the next call registers again (one attempt) and goes on.
  daemon = std::make_unique<DaemonProcess>(o);
  client.snapshot(2);
  client.wait_durable(2);
  CHECK(Committed(o.root, "off", 2));
}

TEST_CASE("CKPT_RECONNECT_BUDGET_S sets the default budget and a bad value is refused", "[restart]") {
  ::setenv("CKPT_RECONNECT_BUDGET_S", "2.5", 1);
  CHECK(Client::connect("/nonexistent/ckptd.sock").reconnect_budget() == std::chrono::milliseconds(2500));
  ClientOptions explicit_budget;
  explicit_budget.reconnect_budget = std::chrono::seconds(7);
  CHECK(Client::connect("/nonexistent/ckptd.sock", explicit_budget).reconnect_budget() ==
        std::chrono::seconds(7));
  ::setenv("CKPT_RECONNECT_BUDGET_S", "soon", 1);
  CHECK_THROWS_WITH(Client::connect("/nonexistent/ckptd.sock"),
                    Catch::Contains("CKPT_RECONNECT_BUDGET_S='soon'"));
  ::unsetenv("CKPT_RECONNECT_BUDGET_S");
  CHECK(Client::connect("/nonexistent/ckptd.sock").reconnect_budget() >= std::chrono::seconds(60));
}

TEST_CASE("a graceful restart (SIGTERM, start) between calls: the registration goes on", "[restart]") {
  TempDir dir("restart-term");
  const DaemonOptions o = Options(dir);
  auto daemon = std::make_unique<DaemonProcess>(o);
  TrainerState state(2, 1 << 20, 3);
  Client client = Client::connect(o.socket);
  client.register_items("term", 0, 1, state.Items());
  state.Fill(1);
  client.snapshot(1);
  client.wait_durable(1);
  CHECK(daemon->Stop() == 0);
  daemon = std::make_unique<DaemonProcess>(o);
  // The daemon's status names it: another instance than before.
  state.Fill(2);
  client.snapshot(2);
  client.wait_durable(2);
  CHECK(Committed(o.root, "term", 2));
  CHECK_NOTHROW(client.wait_durable(1));  // committed before the restart
  const std::string status = client.status().json;
  CHECK(status.find("\"daemon_instance\"") != std::string::npos);
  // One session on the new daemon: the restart did not leave a second registration.
  CHECK(daemon->Status().clients_size() == 1);
}
