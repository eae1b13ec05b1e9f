// A daemon that cannot start says why and exits non-zero, never crashes: a root or a local
// tier under a regular file, a job whose `latest` is a directory. (Before the daemon was
// built part by part, each of these crashed with SIGSEGV and no message.)
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "support/daemon_process.h"
#include "support/test_dirs.h"

using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

// Runs ckptd with `args` under a 60 s limit (exit 124 would mean it served instead).
ProcessResult RunDaemon(const TempDir& dir, std::vector<std::string> args) {
  std::vector<std::string> argv = {
      "/usr/bin/timeout", "60", CKPTD_BINARY,  "--socket", dir.path() + "/s/ckptd.sock",
      "--pool-mib",       "16", "--chunk-mib", "1", "--create-root"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

void CheckRefused(const ProcessResult& r, const std::string& reason) {
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("cannot start") != std::string::npos);
  CHECK(r.output.find(reason) != std::string::npos);
}

}  // namespace

TEST_CASE("a root under a regular file is refused with the reason", "[startup]") {
  TempDir dir("start");
  std::ofstream(dir.path() + "/file") << "x";
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/file/root"}), dir.path() + "/file/root");
}

TEST_CASE("a local tier under a regular file is refused with the reason", "[startup]") {
  TempDir dir("start");
  std::ofstream(dir.path() + "/file") << "x";
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/root", "--local", dir.path() + "/file/local"}),
               "local tier " + dir.path() + "/file/local");
}

TEST_CASE("a job whose latest is a directory stops the start with the reason", "[startup]") {
  TempDir dir("start");
  const std::string job = dir.path() + "/root/job";
  fs::create_directories(job + "/v0000000001");
  std::ofstream(job + "/v0000000001/COMMITTED") << "";
  fs::create_directories(job + "/latest");
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/root"}), "recover job job");
}

// The flags' check sees through links only where the paths exist: a local tier reached
// through a link to the root's parent, in a directory made at start, was the persistent tier
// itself, and the local tier's retention deleted committed versions (found by review).
TEST_CASE("a local tier that is the root through a link, or inside it, is refused", "[startup]") {
  TempDir dir("start");
  fs::create_directories(dir.path() + "/pfs");
  fs::create_symlink(dir.path() + "/pfs", dir.path() + "/scratch");
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/pfs/ckpt", "--local", dir.path() + "/scratch/ckpt"}),
               "are the same directory or one holds the other");
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/pfs/ckpt", "--local", dir.path() + "/pfs/ckpt/local"}),
               "are the same directory or one holds the other");
  CheckRefused(RunDaemon(dir, {"--root", dir.path() + "/pfs/ckpt/inner", "--local", dir.path() + "/pfs/ckpt"}),
               "are the same directory or one holds the other");
}
