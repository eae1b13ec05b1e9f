// ckpt-toy-trainer's state options with a real ckptd, as bench/capacity.sh uses them: frozen
// tensors keep what step 0 wrote, a restore of an older version (--resume-version) checks
// every byte against that step, and options that cannot hold are refused before anything
// starts.
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> Trainer(const DaemonProcess& daemon, std::vector<std::string> extra) {
  std::vector<std::string> args = {TOY_TRAINER_BINARY, "--socket",  daemon.socket(), "--job", "toy",
                                   "--state-mib",      "4",         "--tensors",     "4",     "--compute-ms",
                                   "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace

TEST_CASE("frozen tensors keep step 0's values, and an older version restores byte-exact", "[toy][restore]") {
  TempDir dir("toy-frozen");
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  DaemonProcess daemon(o);

  // One step per run, so that no version is superseded before it is persisted: each run
  // waits for its last version to commit, and the next resumes from it.
  for (std::uint64_t v = 1; v <= 3; ++v) {
    std::vector<std::string> extra = {"--iters", std::to_string(v), "--frozen-tensors", "3"};
    if (v > 1) extra.push_back("--resume");
    ProcessResult run = RunProcess(Trainer(daemon, extra));
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    REQUIRE(fs::exists(o.root + "/toy/" + VersionDirName(v) + "/COMMITTED"));
  }

  // Version 2, not the newest: three tensors as step 0 wrote them, the last as step 2 did.
  ProcessResult older =
      RunProcess(Trainer(daemon, {"--iters", "2", "--frozen-tensors", "3", "--resume", "--resume-version", "2"}));
  INFO(older.output);
  CHECK(older.exit_code == 0);
  CHECK(older.output.find("restored version 2 from") != std::string::npos);
  CHECK(older.output.find("every byte verified") != std::string::npos);

  // The same version checked as if nothing were frozen: tensor 0 holds step 0's values, not
  // step 2's, and the check says so.
  ProcessResult unfrozen = RunProcess(Trainer(daemon, {"--iters", "2", "--resume", "--resume-version", "2"}));
  INFO(unfrozen.output);
  CHECK(unfrozen.exit_code == 3);
  CHECK(unfrozen.output.find("RESUME FAILED: tensor 0 differs") != std::string::npos);
}

TEST_CASE("ckpt-toy-trainer refuses more frozen tensors than tensors, and --resume-version without --resume",
          "[toy]") {
  TempDir dir("toy-bad");
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  DaemonProcess daemon(o);

  ProcessResult too_many = RunProcess(Trainer(daemon, {"--iters", "1", "--frozen-tensors", "5"}));
  CHECK(too_many.exit_code == 2);
  CHECK(too_many.output.find("--frozen-tensors 5 is more than --tensors 4") != std::string::npos);
  ProcessResult alone = RunProcess(Trainer(daemon, {"--iters", "1", "--resume-version", "1"}));
  CHECK(alone.exit_code == 2);
  CHECK(alone.output.find("--resume-version needs --resume") != std::string::npos);
  // Nothing was registered or written by either.
  CHECK_FALSE(fs::exists(o.root + "/toy"));
}
