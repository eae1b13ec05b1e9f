// What ckptd leaves in /dev/shm: the daemon creates no shared memory of its own (its memory
// tier is anonymous memory), and it removes the names of a trainer that died registered,
// which can no longer do so itself: while it runs (its reaper), and at a clean SIGTERM stop,
// however shortly before it the trainer died.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

// The shm objects libckpt created in process `pid` (/dev/shm/ckpt-UID-PID-*).
std::vector<std::string> ShmOf(pid_t pid) {
  const std::string prefix = "ckpt-" + std::to_string(::getuid()) + "-" + std::to_string(pid) + "-";
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  }
  return out;
}

// Removes what the daemon failed to, at the end of the test: a failing run leaves nothing
// either.
struct ShmSweep {
  const pid_t& pid;
  ~ShmSweep() {
    std::error_code ec;
    for (const auto& n : ShmOf(pid)) fs::remove(n, ec);
  }
};

bool Registered(const DaemonProcess& d, pid_t pid) {
  const auto status = d.Status();
  for (const auto& c : status.clients()) {
    if (c.pid() == pid) return true;
  }
  return false;
}

DaemonOptions Options(const TempDir& dir) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  return o;
}

// A toy trainer that registers and then computes for as long as the test runs.
pid_t StartIdleTrainer(const DaemonProcess& d, const std::string& log) {
  return StartProcess({TOY_TRAINER_BINARY, "--socket", d.socket(), "--job", "leftovers", "--state-mib", "1",
                       "--tensors", "2", "--iters", "1000", "--compute-ms", "600000", "--quiet"},
                      log);
}

}  // namespace

TEST_CASE("a trainer killed just before the daemon's SIGTERM leaves no shared memory behind", "[leftovers]") {
  TempDir dir("leftovers-stop");
  DaemonProcess daemon(Options(dir));
  const pid_t trainer = StartIdleTrainer(daemon, dir.path() + "/trainer.log");
  const ShmSweep sweep{trainer};
  REQUIRE(Eventually([&] { return Registered(daemon, trainer); }));
  const std::vector<std::string> names = ShmOf(trainer);
  REQUIRE_FALSE(names.empty());
  // Killed with -9, the trainer removes nothing; the daemon stops before its reaper's next
  // pass (every 250 ms) would have seen the trainer gone.
  ::kill(trainer, SIGKILL);
  REQUIRE(WaitProcess(trainer) == 128 + SIGKILL);
  REQUIRE(daemon.Stop() == 0);
  for (const auto& n : names) {
    INFO(n);
    CHECK_FALSE(fs::exists(n));
  }
  CHECK(ShmOf(trainer).empty());
  CHECK_FALSE(fs::exists(daemon.socket()));
}

TEST_CASE("a running daemon removes the shared memory of a trainer that died registered", "[leftovers]") {
  TempDir dir("leftovers-reap");
  DaemonProcess daemon(Options(dir));
  const pid_t trainer = StartIdleTrainer(daemon, dir.path() + "/trainer.log");
  const ShmSweep sweep{trainer};
  REQUIRE(Eventually([&] { return Registered(daemon, trainer); }));
  REQUIRE_FALSE(ShmOf(trainer).empty());
  ::kill(trainer, SIGKILL);
  REQUIRE(WaitProcess(trainer) == 128 + SIGKILL);
  CHECK(Eventually([&] { return ShmOf(trainer).empty(); }, std::chrono::seconds(10)));
  CHECK(Eventually([&] { return !Registered(daemon, trainer); }, std::chrono::seconds(10)));
}
