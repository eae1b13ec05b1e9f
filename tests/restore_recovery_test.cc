// Recovery after kill -9 with a real ckptd: the restart waits for its rank's newest version
// only, never for an older one whose write is stuck, restores it from memory with every
// checksum verified, and the restored trainer's next checkpoints are taken and commit while
// the older version is still stuck. The stuck write is the test pause point "publish"
// (held while a file exists), on the daemon's default tiers (memory and persistent) and
// with a local tier. The restore logs where its time went.
#include <signal.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

bool Committed(const std::string& root, const std::string& job, std::uint64_t v) {
  return fs::exists(root + "/" + job + "/" + VersionDirName(v) + "/COMMITTED");
}

}  // namespace

TEST_CASE("kill -9 while an older version's write is stuck: the restart restores the newest from memory, and "
          "the next checkpoints commit",
          "[restore][crash]") {
  const bool local = GENERATE(false, true);
  INFO((local ? "with a local tier" : "default tiers (memory, persistent)"));
  TempDir dir(local ? "rr-local" : "rr-default");
  const std::string job = "recover", pause = dir.path() + "/pause";
  { std::ofstream(pause) << "hold"; }
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  if (local) o.extra_args = {"--local", dir.path() + "/local"};
  // Version 1's shard stops before it is published (a write that does not return), for
  // as long as `pause` exists.
  o.env = {"CKPTD_TEST_PAUSE=publish:1:" + pause};
  DaemonProcess daemon(o);
  struct Unpause {
    std::string path;
    ~Unpause() { fs::remove(path); }  // before the daemon stops: its stop would wait on the pause
  } unpause{pause};
  const std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", job, "--state-mib", "8",
      "--tensors",        "2",        "--compute-ms",  "5"};

  auto args = base;
  args.insert(args.end(), {"--iters", "10", "--crash-at", "2"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));  // version 1 is stuck

  // The restart: its newest version (2) is what it restores, from memory, while version 1
  // is still stuck; then it checkpoints versions 3 and 4 and waits for 4 to commit.
  args = base;
  args.insert(args.end(), {"--iters", "4", "--resume"});
  const std::string out = dir.path() + "/resumed.log";
  const pid_t resumed = StartProcess(args, out);
  int status = 0;
  REQUIRE(::waitpid(resumed, &status, 0) == resumed);
  const std::string output = ReadFile(out);
  INFO(output);
  INFO(daemon.Log());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // The trainer checked every byte against version 2's content.
  CHECK(output.find("restored version 2 from memory") != std::string::npos);
  CHECK(output.find("every byte verified") != std::string::npos);
  CHECK(fs::exists(pause));
  CHECK(Committed(o.root, job, 2));
  CHECK(Committed(o.root, job, 4));
  CHECK_FALSE(Committed(o.root, job, 1));
  const std::string log = daemon.Log();
  // Where the restore's time went, and what the restart waited for: version 2, not 1.
  CHECK(std::regex_search(log, std::regex("job " + job +
                                          " rank 0: restore of version 2 from memory: wait [0-9.]+ ms, plan [0-9.]+ "
                                          "ms, verify [0-9.]+ ms \\(preallocation beside it [0-9.]+ ms\\), copy [0-9.]+ ms, "
                                          "registration [0-9.]+ ms, total "
                                          "[0-9.]+ ms")));
  CHECK(std::regex_search(log, std::regex("job " + job + " rank 0: restart waited [0-9.]+ ms for version 2 ")));
  CHECK(log.find("for version 1 of its earlier registration") == std::string::npos);
}

TEST_CASE("a restart that waits for its newest version allocates its regions meanwhile, and restores every byte",
          "[restore][crash]") {
  TempDir dir("rr-wait");
  const std::string job = "waits", pause = dir.path() + "/pause";
  { std::ofstream(pause) << "hold"; }
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  // The newest version (2) stops before it is captured until the restart waits for it.
  o.env = {"CKPTD_TEST_PAUSE=capture:2:" + pause};
  DaemonProcess daemon(o);
  struct Unpause {
    std::string path;
    ~Unpause() { fs::remove(path); }
  } unpause{pause};
  const std::vector<std::string> base = {
      TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", job, "--state-mib", "8",
      "--tensors",        "2",        "--compute-ms",  "5"};
  auto args = base;
  args.insert(args.end(), {"--iters", "10", "--crash-at", "2"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));

  args = base;
  args.insert(args.end(), {"--iters", "3", "--resume"});
  const std::string out = dir.path() + "/resumed.log";
  const pid_t resumed = StartProcess(args, out);
  REQUIRE(Eventually([&] {
    return daemon.Log().find("job " + job + " rank 0: restart waits for version 2, still on its way") !=
           std::string::npos;
  }));
  // Nothing is faulted in before the version is out of the dead trainer's memory.
  CHECK(daemon.Log().find("job " + job + " rank 0: regions faulted in") == std::string::npos);
  fs::remove(pause);  // version 2 is captured, persisted and committed: the restart goes on
  int status = 0;
  REQUIRE(::waitpid(resumed, &status, 0) == resumed);
  const std::string output = ReadFile(out);
  INFO(output);
  INFO(daemon.Log());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // Into the regions allocated while it waited, with every byte checked by the trainer.
  CHECK(output.find("restored version 2 from memory") != std::string::npos);
  CHECK(output.find("every byte verified") != std::string::npos);
  CHECK(Committed(o.root, job, 3));
  const std::string log = daemon.Log();
  CHECK(std::regex_search(log, std::regex("job " + job + " rank 0: restart waited [0-9.]+ ms for version 2 "
                                          "of its earlier registration \\(in flight when it registered\\), then "
                                          "[0-9.]+ ms for its regions to be faulted in")));
  // The pages were faulted in once version 2 was out of the dead trainer's memory, before
  // the registration ended; the restore then had nothing left to allocate.
  const auto faulted = log.find("job " + job + " rank 0: regions faulted in for the restore in ");
  const auto waited = log.find("job " + job + " rank 0: restart waited ");
  REQUIRE(faulted != std::string::npos);
  REQUIRE(waited != std::string::npos);
  CHECK(faulted < waited);
  CHECK(std::regex_search(log, std::regex("job " + job + " rank 0: restore of version 2 from memory: .*"
                                          "\\(preallocation beside it 0\\.0 ms\\)")));
}
