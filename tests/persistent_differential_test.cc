// Differential versions on the persistent tier (ckptd --persistent-base-every), with real
// daemons and ckpt-toy-trainer: a version whose tensors mostly did not change is persisted with
// only the changed items, every version restores byte-exact from the persistent tier alone,
// the offline readers (ckptctl verify, inspect, export) follow the reference to the base, and
// retention keeps a base while a version on the tree reads from it, across a kill -9 in the
// middle of a deletion.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/paths.h"
#include "format/shard_files.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

DaemonOptions Options(const TempDir& dir, const std::string& local, std::vector<std::string> extra) {
  DaemonOptions o;
  // 1 MiB chunks: a shard of 4 MiB of tensors spans several, and so do the pieces its
  // differential write gathers and the reads of its restore.
  o.chunk_mib = 1;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--local", local, "--create-root"};
  o.extra_args.insert(o.extra_args.end(), extra.begin(), extra.end());
  return o;
}

// One step per run, so that no version is superseded before it is persisted: each run waits
// for its version to commit, and the next resumes from it. 4 tensors of state_mib / 4, 3 frozen.
std::vector<std::string> StepArgs(const DaemonProcess& daemon, std::uint64_t v, std::vector<std::string> extra = {},
                                  int state_mib = 4) {
  const bool restore = std::find(extra.begin(), extra.end(), "--resume-version") != extra.end();
  std::vector<std::string> args = {TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "toy", "--state-mib",
                                   std::to_string(state_mib), "--tensors", "4", "--frozen-tensors", "3",
                                   "--compute-ms", "1", "--iters", std::to_string(v)};
  if (v > 1 || restore) args.push_back("--resume");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

ProcessResult Step(const DaemonProcess& daemon, std::uint64_t v, std::vector<std::string> extra = {},
                   int state_mib = 4) {
  return RunProcess(StepArgs(daemon, v, std::move(extra), state_mib));
}

// Starts step `v` in the background and kills the daemon once it holds at the pause point
// `gate` names (a CKPTD_TEST_PAUSE of the daemon's); the trainer is reaped, the gate removed.
void KillWhenPaused(DaemonProcess& daemon, std::uint64_t v, const std::string& gate, const std::string& log,
                    const std::function<void()>& meanwhile = {}) {
  { std::ofstream(gate) << "hold"; }
  const pid_t trainer = StartProcess(StepArgs(daemon, v), log);
  REQUIRE(Eventually([&] { return fs::exists(gate + ".reached"); }, std::chrono::seconds(60)));
  if (meanwhile) meanwhile();
  daemon.Kill9();
  (void)WaitProcess(trainer);
  fs::remove(gate);
}

std::string Shard(const std::string& root, std::uint64_t v) {
  return root + "/toy/" + VersionDirName(v) + "/" + ShardFileName(0);
}

std::vector<std::string> RefsIn(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (ParseBaseRefName(name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// name -> bytes of every tensor in the safetensors files of an export directory.
std::map<std::string, std::string> Exported(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::string file((std::istreambuf_iterator<char>(in)), {});
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
    auto header = nlohmann::json::parse(file.substr(8, n));
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      const auto b = it.value()["data_offsets"][0].get<std::uint64_t>();
      const auto end = it.value()["data_offsets"][1].get<std::uint64_t>();
      out[it.key()] = file.substr(8 + n + b, end - b);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("with --persistent-base-every, mostly unchanged versions are persisted differential and every version "
          "restores byte-exact from the persistent tier",
          "[differential][restore]") {
  TempDir dir("pdiff");
  const std::string root = dir.path() + "/persistent";
  {
    DaemonProcess daemon(Options(dir, dir.path() + "/local", {"--persistent-base-every", "3"}));
    for (std::uint64_t v = 1; v <= 5; ++v) {
      ProcessResult run = Step(daemon, v, {}, 40);
      INFO(run.output);
      REQUIRE(run.exit_code == 0);
      REQUIRE(fs::exists(root + "/toy/" + VersionDirName(v) + "/COMMITTED"));
    }
    INFO(daemon.Log());
    CHECK_THAT(daemon.Log(), Catch::Contains("persisted differential over base version 1"));
  }

  // Version 1 has no base; 2 and 3 read from 1; 4 is three versions past 1, so whole; 5 reads from 4.
  const std::map<std::uint64_t, std::uint64_t> want_base = {{2, 1}, {3, 1}, {5, 4}};
  std::uint64_t whole_bytes = 0;
  for (std::uint64_t v = 1; v <= 5; ++v) {
    INFO("version " << v);
    auto info = ReadShardHeader(Shard(root, v));
    REQUIRE(info.ok());
    auto base = want_base.find(v);
    if (base == want_base.end()) {
      CHECK_FALSE(info->base.has_value());
      whole_bytes = info->file_bytes;
      continue;
    }
    REQUIRE(info->base == std::optional<std::uint64_t>(base->second));
    // Three of four tensors are left to the base.
    std::size_t left = 0;
    for (const auto& item : info->items) left += item.in_base ? 1 : 0;
    CHECK(left == 3);
    CHECK(info->file_bytes * 3 < whole_bytes);
  }
  // Version 1's directory holds the references of 2 and 3, version 4's that of 5.
  CHECK(RefsIn(root + "/toy/" + VersionDirName(1)).size() == 2);
  CHECK(RefsIn(root + "/toy/" + VersionDirName(4)).size() == 1);

  // Offline readers: verify follows the reference; inspect says so.
  ProcessResult verify = RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", "toy", "--version", "3"});
  INFO(verify.output);
  CHECK(verify.exit_code == 0);
  ProcessResult inspect = RunProcess({CKPTCTL_BINARY, "inspect", Shard(root, 3)});
  CHECK_THAT(inspect.output, Catch::Contains("are the unchanged items of base version 1") &&
                                 Catch::Contains("(in base)"));

  // Export: a differential version's frozen tensors are its base's bytes, its trained one its own.
  ProcessResult e1 = RunProcess({CKPTCTL_BINARY, "export", "--root", root, "--job", "toy", "--version", "1", "--out",
                                 dir.path() + "/export1"});
  ProcessResult e3 = RunProcess({CKPTCTL_BINARY, "export", "--root", root, "--job", "toy", "--version", "3", "--out",
                                 dir.path() + "/export3"});
  INFO(e1.output << e3.output);
  REQUIRE(e1.exit_code == 0);
  REQUIRE(e3.exit_code == 0);
  auto x1 = Exported(dir.path() + "/export1");
  auto x3 = Exported(dir.path() + "/export3");
  REQUIRE(x1.size() == 4);
  REQUIRE(x3.size() == 4);
  int same = 0;
  for (const auto& [name, bytes] : x3) {
    INFO(name);
    REQUIRE(x1.count(name) == 1);
    CHECK(bytes.size() == (10u << 20));
    same += bytes == x1[name] ? 1 : 0;
  }
  CHECK(same == 3);

  // A fresh daemon with an empty local tier: every version from the persistent tier alone,
  // through a pool of 4 chunks, fewer than a shard of 40 MiB has (the restore reads it twice:
  // verified, then checked again and copied).
  DaemonOptions small = Options(dir, dir.path() + "/local2", {"--persistent-base-every", "3"});
  small.pool_mib = 16;
  small.chunk_mib = 4;
  DaemonProcess fresh(small);
  for (std::uint64_t v = 5; v >= 1; --v) {
    ProcessResult restore = Step(fresh, v, {"--resume-version", std::to_string(v)}, 40);
    INFO(restore.output);
    CHECK(restore.exit_code == 0);
    CHECK_THAT(restore.output, Catch::Contains("restored version " + std::to_string(v) + " from persistent") &&
                                   Catch::Contains("every byte verified"));
  }
}

TEST_CASE("a differential version whose base is damaged is refused with the base named, and the restore falls "
          "back to nothing silently wrong",
          "[differential][restore]") {
  TempDir dir("pdiffbad");
  const std::string root = dir.path() + "/persistent";
  {
    DaemonProcess daemon(Options(dir, dir.path() + "/local", {"--persistent-base-every", "4"}));
    for (std::uint64_t v = 1; v <= 2; ++v) REQUIRE(Step(daemon, v).exit_code == 0);
  }
  auto base = ReadShardHeader(Shard(root, 1));
  REQUIRE(base.ok());
  {
    // One byte of a frozen tensor, which version 2 reads from version 1.
    std::fstream f(Shard(root, 1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(base->data_start + base->items.front().offset + 100));
    f.put('\x5a');
  }
  ProcessResult verify = RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", "toy", "--version", "2"});
  CHECK(verify.exit_code != 0);
  CHECK_THAT(verify.output, Catch::Contains("checksum mismatch") && Catch::Contains(VersionDirName(1)));

  DaemonProcess fresh(Options(dir, dir.path() + "/local2", {"--persistent-base-every", "4"}));
  ProcessResult restore = Step(fresh, 2, {"--resume-version", "2"});
  INFO(restore.output);
  CHECK(restore.exit_code != 0);
  CHECK_THAT(restore.output, !Catch::Contains("every byte verified"));
}

TEST_CASE("retention keeps a base while a version on the tree reads from it, and deletes it once none does",
          "[differential][retention]") {
  TempDir dir("pdiffkeep");
  const std::string root = dir.path() + "/persistent";
  DaemonProcess daemon(Options(dir, dir.path() + "/local", {"--persistent-base-every", "3", "--keep-last", "1"}));
  auto exists = [&](std::uint64_t v) { return fs::exists(root + "/toy/" + VersionDirName(v)); };
  for (std::uint64_t v = 1; v <= 3; ++v) REQUIRE(Step(daemon, v).exit_code == 0);
  // Only 3 is kept by --keep-last 1, and 1 because 3 reads from it; 2 is gone.
  CHECK(exists(1));
  CHECK_FALSE(exists(2));
  CHECK(exists(3));
  CHECK(fs::exists(root + "/toy/" + VersionDirName(1) + "/COMMITTED"));
  ProcessResult r3 = RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", "toy", "--version", "3"});
  CHECK(r3.exit_code == 0);

  // Version 4 is whole: 3 goes, and with it the last reference to 1.
  REQUIRE(Step(daemon, 4).exit_code == 0);
  CHECK_FALSE(exists(1));
  CHECK_FALSE(exists(3));
  CHECK(exists(4));
}

TEST_CASE("a daemon killed in the middle of deleting versions leaves every committed version readable",
          "[differential][retention][crash]") {
  TempDir dir("pdiffkill");
  const std::string root = dir.path() + "/persistent";
  const std::string gate = dir.path() + "/retention-wait";
  std::vector<std::string> flags = {"--persistent-base-every", "3", "--keep-last", "1"};
  {
    DaemonOptions o = Options(dir, dir.path() + "/local", flags);
    o.env = {"CKPTD_TEST_PAUSE=retention-delete:0:" + gate};
    DaemonProcess daemon(o);
    REQUIRE(Step(daemon, 1).exit_code == 0);
    REQUIRE(Step(daemon, 2).exit_code == 0);  // nothing deleted: 1 is 2's base
    // Version 3 commits, and retention stops with version 2's COMMITTED removed, its files not yet.
    KillWhenPaused(daemon, 3, gate, dir.path() + "/trainer3.log");
  }
  // Committed now: 1 (a base) and 3, which reads from it; 2 is half deleted, not committed.
  CHECK(fs::exists(root + "/toy/" + VersionDirName(1) + "/COMMITTED"));
  CHECK(fs::exists(root + "/toy/" + VersionDirName(3) + "/COMMITTED"));
  CHECK_FALSE(fs::exists(root + "/toy/" + VersionDirName(2) + "/COMMITTED"));
  for (std::uint64_t v : {1, 3}) {
    ProcessResult verify =
        RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", "toy", "--version", std::to_string(v)});
    INFO(verify.output);
    CHECK(verify.exit_code == 0);
  }
  // Restarted, the daemon goes on: version 4 is whole, and the next retention removes what
  // no version reads from.
  DaemonProcess again(Options(dir, dir.path() + "/local", flags));
  ProcessResult restore = Step(again, 3, {"--resume-version", "3"});
  INFO(restore.output);
  CHECK(restore.exit_code == 0);
  REQUIRE(Step(again, 4).exit_code == 0);
  CHECK(fs::exists(root + "/toy/" + VersionDirName(4) + "/COMMITTED"));
  CHECK_FALSE(fs::exists(root + "/toy/" + VersionDirName(1)));
  CHECK_FALSE(fs::exists(root + "/toy/" + VersionDirName(3)));
}

TEST_CASE("a base referenced while retention was deleting it, and the daemon killed there, is committed again",
          "[differential][retention][crash]") {
  TempDir dir("pdiffundo");
  const std::string root = dir.path() + "/persistent";
  const std::string gate = dir.path() + "/retention-wait";
  // Base every 2: 1 whole, 2 over 1, 3 whole, 4 over 3.
  std::vector<std::string> flags = {"--persistent-base-every", "2", "--keep-last", "1"};
  const std::string v1 = root + "/toy/" + VersionDirName(1);
  {
    DaemonOptions o = Options(dir, dir.path() + "/local", flags);
    o.env = {"CKPTD_TEST_PAUSE=retention-delete:1:" + gate};
    DaemonProcess daemon(o);
    REQUIRE(Step(daemon, 1).exit_code == 0);
    REQUIRE(Step(daemon, 2).exit_code == 0);
    // Version 3 commits: retention deletes 2, then finds nothing reading 1 and stops there, with
    // 1's COMMITTED removed and its references not looked at again.
    KillWhenPaused(daemon, 3, gate, dir.path() + "/trainer3.log", [&] {
      CHECK_FALSE(fs::exists(v1 + "/COMMITTED"));
      CHECK(fs::exists(v1 + "/DELETING"));
      // Meanwhile another node's daemon found version 1 still committed and wrote a version over it.
      fs::create_directories(root + "/toy/" + VersionDirName(7));
      { std::ofstream(v1 + "/" + BaseRefName(7, "othernode-12345678")); }
    });
  }
  DaemonProcess again(Options(dir, dir.path() + "/local", flags));
  REQUIRE(Step(again, 3, {"--resume-version", "3"}).exit_code == 0);
  REQUIRE(Step(again, 4).exit_code == 0);
  // The next retention put version 1 back: committed, whole, and read by version 7.
  CHECK(fs::exists(v1 + "/COMMITTED"));
  CHECK_FALSE(fs::exists(v1 + "/DELETING"));
  ProcessResult verify = RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", "toy", "--version", "1"});
  INFO(verify.output);
  CHECK(verify.exit_code == 0);
}

TEST_CASE("the flag --persistent-base-every without a local tier is refused at start, saying why",
          "[differential]") {
  TempDir dir("pdiffflag");
  ProcessResult r = RunProcess({CKPTD_BINARY, "--root", dir.path() + "/p", "--create-root", "--socket",
                                dir.path() + "/s.sock", "--persistent-base-every", "4", "--check-config"});
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.output, Catch::Contains("--persistent-base-every needs --local"));
}
