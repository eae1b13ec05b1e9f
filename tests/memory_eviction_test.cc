// The memory tier gives way to running jobs (issue 12, defect 8): images of jobs that have
// no live session any more are kept while there is room (a restart restores them from
// memory) and dropped, least recently used job first, when a running job needs the room.
// Before, seven finished jobs kept 56 of 64 MiB for ever, later jobs got no memory tier, and
// the one warning told the user to raise --memory-mib.
#include <ckpt/client.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <optional>
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

constexpr auto kWait = std::chrono::seconds(30);

// A trainer of `job` whose state is `tensors` x 4 MiB; each job has its own pattern.
struct Trainer {
  Trainer(const DaemonProcess& daemon, const std::string& job, std::size_t tensors)
      : state(tensors, 4 << 20, std::hash<std::string>{}(job)), client(Client::connect(daemon.socket())) {
    client.register_items(job, 0, 1, state.Items());
  }
  void Commit(std::uint64_t v) {
    state.Fill(v);
    client.snapshot(v);
    client.wait_durable(v, Level::kCommitted, kWait);
  }
  // Restores the newest version in place; returns the tier it came from.
  std::string Restore(std::uint64_t expected) {
    state.Fill(999);
    auto r = client.restore();
    CHECK(r.version == expected);
    CHECK(state.FirstMismatch(expected) == -1);
    return r.tier;
  }
  TrainerState state;
  Client client;
};

std::uint64_t MemoryBytes(const DaemonProcess& daemon) {
  auto st = daemon.Status();
  REQUIRE(st.tiers(0).name() == "memory");
  return st.tiers(0).bytes();
}

}  // namespace

TEST_CASE("finished jobs' images give way to running jobs, least recently used first", "[tiers][memory]") {
  TempDir dir("evict");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--memory-mib", "64", "--memory-versions", "1"};
  DaemonProcess daemon(o);

  // A running job (8 MiB), the oldest user of the tier: never dropped while it runs.
  Trainer live(daemon, "live", 2);
  live.Commit(1);
  // Six jobs of 8 MiB that run and finish: 56 of the 64 MiB are now held.
  for (int j = 1; j <= 6; ++j) {
    Trainer t(daemon, "done-" + std::to_string(j), 2);
    t.Commit(1);
    t.client.unregister();
  }
  CHECK(MemoryBytes(daemon) >= 56u << 20);

  // A new job of 16 MiB: the two least recently used finished jobs make room for it.
  Trainer big(daemon, "big", 4);
  big.Commit(1);
  CHECK(big.Restore(1) == "memory");
  CHECK(MemoryBytes(daemon) <= 64u << 20);
  const std::string log = daemon.Log();
  CHECK(log.find("dropping the images of job done-1 (no live session") != std::string::npos);
  CHECK(log.find("dropping the images of job done-2 (no live session") != std::string::npos);
  CHECK(log.find("dropping the images of job done-3") == std::string::npos);
  CHECK(log.find("dropping the images of job live") == std::string::npos);

  // The running job kept its image; the newest finished job restarts from memory; the
  // oldest one, dropped, restores from the persistent tier.
  CHECK(live.Restore(1) == "memory");
  {
    Trainer restarted(daemon, "done-6", 2);
    CHECK(restarted.Restore(1) == "memory");
  }
  {
    Trainer restarted(daemon, "done-1", 2);
    CHECK(restarted.Restore(1) == "persistent");
  }

  // A shard that does not fit even once every finished job is dropped is not kept, and the
  // warning says what holds the budget instead of only "raise --memory-mib".
  Trainer huge(daemon, "huge", 10);  // 40 MiB, with 24 MiB held by running jobs
  huge.Commit(1);
  CHECK(huge.Restore(1) == "persistent");
  const std::string warned = daemon.Log();
  INFO(warned);
  CHECK(warned.find("memory tier: job huge version 1 rank 0 (40 MiB) not kept within the 64 MiB budget") !=
        std::string::npos);
  CHECK(warned.find("held by images of running jobs, which are kept (big 16 MiB") != std::string::npos);
}

TEST_CASE("a trainer killed without unregistering leaves images that give way too",
          "[tiers][memory][crash]") {
  TempDir dir("evict");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--memory-mib", "64", "--memory-versions", "1"};
  DaemonProcess daemon(o);
  // 32 MiB of state, killed -9 right after its first snapshot: no Unregister. The daemon
  // completes that version (the shm stays readable) and keeps its image.
  ProcessResult crashed =
      RunProcess({TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "crashed", "--state-mib", "32",
                  "--tensors", "4", "--iters", "1", "--crash-at", "1"});
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(Eventually([&] { return fs::exists(o.root + "/crashed/" + VersionDirName(1) + "/COMMITTED"); }));
  REQUIRE(MemoryBytes(daemon) >= 32u << 20);
  // A running job of 40 MiB: it fits only if the dead trainer's images give way.
  Trainer next(daemon, "next", 10);
  next.Commit(1);
  CHECK(next.Restore(1) == "memory");
  CHECK(daemon.Log().find("dropping the images of job crashed (no live session") != std::string::npos);
}
