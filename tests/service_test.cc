// ckptd as a service (docs/ops/service.md): the config is strict (an unknown key or flag is
// an error naming it), --check-config and --version exit 0/2 without serving, a missing
// root is an error unless --create-root, existing directories keep their owner and mode,
// a job's new directory belongs to its owner, logs go where systemd or an operator expects
// (priority prefixes under journald, warnings on stderr, --log-file reopened on SIGHUP), and
// SIGHUP reloads what it can instead of killing the daemon.
#include <ckpt/client.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/run_as.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

bool Contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// $CKPTD_BINARY, as DaemonProcess starts it, else the one built with the tests.
std::string Binary() {
  const char* binary = std::getenv("CKPTD_BINARY");
  return binary != nullptr && *binary != '\0' ? binary : CKPTD_BINARY;
}

// ckptd with `args` under a 60 s limit (exit 124 would mean it served instead).
ProcessResult Ckptd(std::vector<std::string> args) {
  std::vector<std::string> argv = {"/usr/bin/timeout", "60", Binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// Base flags of a daemon that could serve in `dir` (a small pool).
std::vector<std::string> Flags(const TempDir& dir, std::vector<std::string> more = {}) {
  std::vector<std::string> f = {"--socket", dir.path() + "/s/ckptd.sock", "--pool-mib", "16", "--chunk-mib",
                                "1"};
  f.insert(f.end(), more.begin(), more.end());
  return f;
}

std::string PersistentRetention(const DaemonProcess& d) {
  const auto reply = d.Status();
  for (const auto& t : reply.tiers()) {
    if (t.name() == "persistent") return t.retention();
  }
  return "";
}

}  // namespace

// -- config and exit codes -------------------------------------------------------------------

// Before: CLI11 ignored unknown keys, and `keep_last = 3` ran a daemon keeping every version.
TEST_CASE("an unknown or misspelled config key is an error naming it and the key meant",
          "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  const std::string conf = dir.path() + "/ckptd.conf";
  WriteText(conf, "keep_last = 3\n");
  auto r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "unknown key 'keep_last' in " + conf));
  CHECK(Contains(r.output, "did you mean 'keep-last'"));

  WriteText(conf, "poolmib = 64\n");
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "unknown key 'poolmib'"));
  CHECK(Contains(r.output, "did you mean 'pool-mib'"));

  WriteText(conf, "no-such-option = 1\n");
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "unknown key 'no-such-option'"));

  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--keep_last", "3"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "--keep_last"));
}

TEST_CASE("the restart-waits option takes newest or none, on the command line and in the config file",
          "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  auto r =
      Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--restart-waits", "sometimes", "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "--restart-waits"));
  CHECK(Contains(r.output, "newest"));
  CHECK(Contains(r.output, "none"));
  const std::string conf = dir.path() + "/ckptd.conf";
  WriteText(conf, "restart-waits = none\n");
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 0);
}

// Before: CLI11 kept the first of two settings and dropped the second without a word.
TEST_CASE("a key set twice in the config file is an error, but a list key may repeat", "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  const std::string conf = dir.path() + "/ckptd.conf";
  WriteText(conf, "pool-mib = 64\nkeep-last = 2\npool-mib = 128\n");
  auto r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "key 'pool-mib' is set twice in " + conf));

  WriteText(conf, "allow-uid = 1000\nallow-uid = 1001\n");
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.output, "1001"));
}

// Before: --memory-mib had no bound, and 2^64 / 2^20 or more wrapped the budget in bytes.
TEST_CASE("a memory tier budget too large to be a size is a configuration error", "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  auto r = Ckptd(
      Flags(dir, {"--root", dir.path() + "/root", "--memory-mib", "99999999999999999999", "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "--memory-mib"));
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--memory-mib", "17592186044416", "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "--memory-mib"));
}

// Before: --check-config printed the node id as given (a/b), not the one used (a_b).
TEST_CASE("ckptd --check-config prints the node id the daemon uses", "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  auto r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--node-id", "a/b", "--check-config"}));
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.output, "node-id=\"a_b\""));
  r = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--check-config"}));
  INFO(r.output);
  CHECK_FALSE(Contains(r.output, "node-id=\"\""));
}

TEST_CASE("ckptd --version prints the version and exits 0", "[service][config]") {
  auto r = Ckptd({"--version"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.rfind("ckptd ", 0) == 0);
  CHECK(r.output.find_first_of("0123456789") == 6);
}

TEST_CASE("ckptd --check-config prints the effective config and exits 0, or the error and 2",
          "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  const std::string conf = dir.path() + "/ckptd.conf";
  WriteText(conf, "keep-last = 3\nlog-level = \"debug\"\n");
  auto ok = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--config", conf, "--check-config"}));
  INFO(ok.output);
  CHECK(ok.exit_code == 0);
  CHECK(Contains(ok.output, "configuration OK"));
  CHECK(Contains(ok.output, "keep-last=3\n"));
  CHECK(Contains(ok.output, "log-level=\"debug\"\n"));
  CHECK(Contains(ok.output, "root=\"" + dir.path() + "/root\"\n"));
  CHECK_FALSE(fs::exists(dir.path() + "/s"));  // checked, not created

  auto bad_mode =
      Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--socket-mode", "0999", "--check-config"}));
  CHECK(bad_mode.exit_code == 2);
  CHECK(Contains(bad_mode.output, "--socket-mode"));
  auto bad_number =
      Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--writers", "lots", "--check-config"}));
  CHECK(bad_number.exit_code == 2);
  CHECK(Contains(bad_number.output, "--writers"));
  auto bad_group = Ckptd(
      Flags(dir, {"--root", dir.path() + "/root", "--socket-group", "no-such-group-x", "--check-config"}));
  CHECK(bad_group.exit_code == 2);
  CHECK(Contains(bad_group.output, "no-such-group-x: no such group"));
  auto no_root = Ckptd(Flags(dir, {"--root", dir.path() + "/nope", "--check-config"}));
  CHECK(no_root.exit_code == 2);
  CHECK(Contains(no_root.output, dir.path() + "/nope does not exist"));
}

// deploy/ckptd.conf is what operators copy: every key in it must parse.
TEST_CASE("deploy/ckptd.conf passes --check-config", "[service][config]") {
  TempDir dir("svc");
  fs::create_directories(dir.path() + "/root");
  // Flags win over the file: the root and socket move to the scratch directory.
  auto r = Ckptd({"--config", CKPT_SOURCE_DIR "/deploy/ckptd.conf", "--root", dir.path() + "/root",
                  "--socket", dir.path() + "/s/ckptd.sock", "--check-config"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.output, "keep-last=3\n"));
}

// -- the root ---------------------------------------------------------------------------------

// Before: a missing --root was created silently, so an unmounted file system meant
// checkpoints on the local disk under its mount point.
TEST_CASE("a missing root or local tier is an error unless --create-root", "[service][root]") {
  TempDir dir("svc");
  auto r = Ckptd(Flags(dir, {"--root", dir.path() + "/pfs/ckpt"}));
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "--root " + dir.path() + "/pfs/ckpt does not exist"));
  CHECK(Contains(r.output, "--create-root"));
  CHECK_FALSE(fs::exists(dir.path() + "/pfs"));
  CHECK_FALSE(fs::exists(dir.path() + "/s"));

  fs::create_directories(dir.path() + "/root");
  auto local = Ckptd(Flags(dir, {"--root", dir.path() + "/root", "--local", dir.path() + "/nvme/ckpt"}));
  INFO(local.output);
  CHECK(local.exit_code == 2);
  CHECK(Contains(local.output, "--local " + dir.path() + "/nvme/ckpt does not exist"));
  CHECK_FALSE(fs::exists(dir.path() + "/nvme"));

  DaemonOptions o;
  o.root = dir.path() + "/made/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--local", dir.path() + "/made/local"};
  o.create_root = true;
  DaemonProcess d(o);
  CHECK(fs::is_directory(dir.path() + "/made/root"));
  CHECK(fs::is_directory(dir.path() + "/made/local"));
}

// The prolog took over a world-readable shared root (install -d -m 0700 -o user);
// the daemon must not do the same.
TEST_CASE("existing root and local directories keep their owner and mode", "[service][root]") {
  TempDir dir("svc");
  const std::string root = dir.path() + "/root", local = dir.path() + "/local";
  fs::create_directories(root);
  fs::create_directories(local);
  ::chmod(root.c_str(), 0755);
  ::chmod(local.c_str(), 0751);
  const uid_t other = ::geteuid() == 0 ? 65534 : ::geteuid();
  if (::geteuid() == 0) REQUIRE(::chown(local.c_str(), other, static_cast<gid_t>(-1)) == 0);
  DaemonOptions o;
  o.root = root;
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--local", local};
  o.create_root = false;
  {
    DaemonProcess d(o);
    auto run = RunProcess(ToyTrainerArgs(d.socket(), "kept", 2));
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
  }
  struct stat st {};
  REQUIRE(::stat(root.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0755);
  REQUIRE(::stat(local.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0751);
  CHECK(st.st_uid == other);
}

// Per-job directories belong to the job's owner: a root daemon creating ROOT/JOB for uid
// 65534 hands it over; one that existed before keeps its owner.
TEST_CASE("a job directory the daemon creates belongs to the job's owner", "[service][root][multi-user]") {
  if (::geteuid() != 0) {
    WARN("needs root to act as another uid; skipped");
    return;
  }
  constexpr uid_t kUser = 65534;
  TempDir dir("svc");
  ::chmod(dir.path().c_str(), 0755);
  fs::create_directories(dir.path() + "/root");
  fs::create_directories(dir.path() + "/s");
  ::chmod((dir.path() + "/s").c_str(), 0755);
  fs::create_directories(dir.path() + "/root/premade");  // made by an operator, root's
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--socket-mode", "0666", "--allow-uid", std::to_string(kUser)};
  DaemonProcess d(o);
  auto run_as_user = [&](const std::string& job) {
    std::vector<std::string> argv = {"/usr/sbin/runuser", "-u", "nobody", "--"};
    auto t = ToyTrainerArgs(d.socket(), job, 2);
    argv.insert(argv.end(), t.begin(), t.end());
    return RunProcess(argv);
  };
  auto run = run_as_user("theirs");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  struct stat st {};
  REQUIRE(::stat((dir.path() + "/root/theirs").c_str(), &st) == 0);
  CHECK(st.st_uid == kUser);
  CHECK((st.st_mode & 07777) == 0700);
  CHECK(ReadFile(dir.path() + "/root/theirs/owner") == "uid=65534\n");

  auto premade = run_as_user("premade");
  INFO(premade.output);
  REQUIRE(premade.exit_code == 0);
  REQUIRE(::stat((dir.path() + "/root/premade").c_str(), &st) == 0);
  CHECK(st.st_uid == 0);
  CHECK(ReadFile(dir.path() + "/root/premade/owner") == "uid=65534\n");
}

// -- the socket ---------------------------------------------------------------------------------

TEST_CASE("a daemon that is not root and cannot make /run/ckptd says to set --socket or CKPTD_SOCKET",
          "[service][socket]") {
  if (::geteuid() != 0 || ::access("/run", W_OK) != 0) {
    WARN("needs root (to run ckptd as nobody); skipped");
    return;
  }
  if (fs::exists("/run/ckptd")) {
    WARN("/run/ckptd exists on this machine; skipped");
    return;
  }
  TempDir dir("svc");
  ::chmod(dir.path().c_str(), 0755);
  fs::create_directories(dir.path() + "/root");
  ::chown((dir.path() + "/root").c_str(), 65534, 65534);
  auto r = RunProcess({"/usr/bin/env", "-u", "CKPTD_SOCKET", "/usr/sbin/runuser", "-u", "nobody", "--",
                       "/usr/bin/timeout", "60", Binary(), "--root", dir.path() + "/root", "--pool-mib", "16",
                       "--chunk-mib", "1"});
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, "/run/ckptd"));
  CHECK(Contains(r.output, "--socket PATH or CKPTD_SOCKET=PATH"));
}

TEST_CASE("ckptd --socket-group and --socket-mode set the socket's group and mode", "[service][socket]") {
  if (::geteuid() != 0) {
    WARN("needs root to give the socket to another group; skipped");
    return;
  }
  const gid_t group = 65534;
  TempDir dir("svc");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--socket-group", std::to_string(group), "--socket-mode", "0660"};
  DaemonProcess d(o);
  struct stat st {};
  REQUIRE(::stat(o.socket.c_str(), &st) == 0);
  CHECK(st.st_gid == group);
  CHECK((st.st_mode & 0777) == 0660);
}

// -- logs ---------------------------------------------------------------------------------------

// A warning at start: more connections allowed than half the open-file limit.
constexpr const char* kWarnFlag = "--max-connections";
constexpr const char* kWarnValue = "100000000";

TEST_CASE("without systemd, warnings go to stderr and the rest to stdout, timestamped", "[service][log]") {
  TempDir dir("svc");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {kWarnFlag, kWarnValue};
  o.stderr_path = dir.path() + "/stderr.log";
  o.env = {"JOURNAL_STREAM="};  // not under systemd, even if these tests are
  DaemonProcess d(o);
  const std::string out = d.Log(), err = ReadFile(o.stderr_path);
  INFO("stdout: " << out << "\nstderr: " << err);
  CHECK(Contains(out, "] info: serving on " + o.socket));
  CHECK_FALSE(Contains(out, "warning: --max-connections"));
  CHECK(Contains(err, "] warning: --max-connections"));
  CHECK_FALSE(Contains(err, "serving on"));
  CHECK(Contains(out, "ckptd[" + std::to_string(d.pid()) + "]"));
}

TEST_CASE("under journald, lines carry syslog priority prefixes and no timestamp or pid", "[service][log]") {
  TempDir dir("svc");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {kWarnFlag, kWarnValue};
  // JOURNAL_STREAM names the device and inode of the stream connected to the journal: here,
  // the log file that DaemonProcess connects stdout and stderr to.
  fs::create_directories(dir.path() + "/s");
  WriteText(o.socket + ".log", "");
  struct stat st {};
  REQUIRE(::stat((o.socket + ".log").c_str(), &st) == 0);
  o.env = {"JOURNAL_STREAM=" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino)};
  DaemonProcess d(o);
  const std::string log = d.Log();
  INFO(log);
  CHECK(Contains(log, "<6>serving on " + o.socket));
  CHECK(Contains(log, "<4>--max-connections"));
  CHECK_FALSE(Contains(log, "ckptd[" + std::to_string(d.pid()) + "]"));
  CHECK_FALSE(Contains(log, "info:"));
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    INFO(line);
    CHECK((line.size() >= 3 && line[0] == '<' && line[2] == '>'));
  }
}

// -- SIGHUP ---------------------------------------------------------------------------------------

// Before: SIGHUP killed the daemon at once (status 129), leaving its socket behind.
TEST_CASE("SIGHUP reopens --log-file for logrotate and the daemon keeps serving", "[service][log][sighup]") {
  TempDir dir("svc");
  const std::string log_file = dir.path() + "/ckptd.log";
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--log-file", log_file};
  DaemonProcess d(o);
  CHECK(Contains(ReadFile(log_file), "info: serving on " + o.socket));
  CHECK_FALSE(Contains(d.Log(), "serving on"));  // nothing on stdout
  fs::rename(log_file, log_file + ".1");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(Eventually(
      [&] { return fs::exists(log_file) && Contains(ReadFile(log_file), "SIGHUP: log file reopened"); }));
  CHECK(d.WaitExit(std::chrono::milliseconds(0)) == -1);
  CHECK(d.Status().daemon_version() != "");
  auto run = RunProcess(ToyTrainerArgs(d.socket(), "afterhup", 1));
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK_FALSE(Contains(ReadFile(log_file + ".1"), "SIGHUP"));
  CHECK(d.Stop() == 0);
  CHECK_FALSE(fs::exists(o.socket));
}

TEST_CASE(
    "SIGHUP applies log-level, keep-last and keep-every, names keys that need a restart, keeps a bad config",
    "[service][sighup]") {
  TempDir dir("svc");
  const std::string conf = dir.path() + "/ckptd.conf";
  WriteText(conf, "keep-last = 0\nidle-timeout-s = 600\n");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--config", conf};
  DaemonProcess d(o);
  CHECK(PersistentRetention(d) == "every version");

  WriteText(conf, "keep-last = 2\nkeep-every = 5\nidle-timeout-s = 30\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(Eventually([&] { return Contains(d.Log(), "SIGHUP: changed, but only a restart"); }));
  const std::string log = d.Log();
  INFO(log);
  CHECK(Contains(log, "applied keep-every 0 -> 5, keep-last 0 -> 2"));
  CHECK(Contains(log, "idle-timeout-s 600 -> 30"));
  CHECK(PersistentRetention(d) == "last 2 committed versions, and every 5th");
  // The new retention holds for the next commits: of versions 1..4, 3 and 4 remain.
  auto run = RunProcess(ToyTrainerArgs(d.socket(), "keep", 4));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  // Retention runs after each commit, so the trainer may see version 4 committed a moment
  // before version 2 is removed.
  CHECK(Eventually([&] {
    return !fs::exists(dir.path() + "/root/keep/v0000000001") &&
           !fs::exists(dir.path() + "/root/keep/v0000000002");
  }));
  CHECK(fs::exists(dir.path() + "/root/keep/v0000000004/COMMITTED"));

  // A config that does not parse changes nothing, and says why.
  WriteText(conf, "keep_last = 1\n");
  REQUIRE(::kill(d.pid(), SIGHUP) == 0);
  REQUIRE(Eventually([&] { return Contains(d.Log(), "does not parse, so the running one is kept"); }));
  CHECK(Contains(d.Log(), "unknown key 'keep_last'"));
  CHECK(PersistentRetention(d) == "last 2 committed versions, and every 5th");
  CHECK(d.WaitExit(std::chrono::milliseconds(0)) == -1);
  CHECK(d.Stop() == 0);
}

// Before: the second daemon ran recovery on the root before it found the socket served, and
// recovery removed the first daemon's temporary file of the shard it was writing (same socket,
// same node id): that version was lost.
TEST_CASE("a second daemon on a served socket leaves the first daemon's shard in flight alone",
          "[service][socket]") {
  TempDir dir("svc");
  const std::string pause = dir.path() + "/pause";
  { std::ofstream(pause) << ""; }
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  o.extra_args = {"--node-id", "samenode"};
  ::setenv("CKPTD_TEST_PAUSE", ("publish:2:" + pause).c_str(), 1);
  DaemonProcess d(o);
  ::unsetenv("CKPTD_TEST_PAUSE");
  TrainerState state(2, 4096);
  Client c = Client::connect(d.socket());
  c.register_items("inflight", 0, 1, state.Items());
  state.Fill(1);
  c.snapshot(1);
  c.wait_durable(1);
  state.Fill(2);
  c.snapshot(2);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  bool tmp_before = false;
  for (const auto& e : fs::recursive_directory_iterator(o.root + "/inflight"))
    tmp_before |= e.path().string().find(".tmp") != std::string::npos;
  REQUIRE(tmp_before);  // the shard of version 2 is written, not yet renamed

  auto second = Ckptd(Flags(dir, {"--root", o.root, "--node-id", "samenode"}));
  INFO(second.output);
  CHECK(second.exit_code == 1);
  CHECK(Contains(second.output, "another daemon is serving " + o.socket));
  CHECK_FALSE(Contains(second.output, "removed"));

  fs::remove(pause);
  c.wait_durable(2);
  CHECK(ReadFile(o.root + "/inflight/latest") == "2\n");
  state.Fill(3);  // clobbered, so that the restore must bring version 2 back
  CHECK(c.restore().version == 2);
  CHECK(state.FirstMismatch(2) == -1);
}

TEST_CASE(
    "a second daemon on a served socket exits 1 and one with an unopenable log file exits 2 while the first "
    "serves on",
    "[service][config]") {
  TempDir dir("svc");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/s/ckptd.sock";
  DaemonProcess d(o);
  auto second = Ckptd(Flags(dir, {"--root", o.root}));
  INFO(second.output);
  CHECK(second.exit_code == 1);
  CHECK(Contains(second.output, "another daemon is serving " + o.socket));
  auto log = Ckptd(Flags(dir, {"--root", o.root, "--log-file", dir.path() + "/no/such/dir/ckptd.log"}));
  INFO(log.output);
  CHECK(log.exit_code == 2);
  CHECK(Contains(log.output, "open log file " + dir.path() + "/no/such/dir/ckptd.log"));
  CHECK(d.Status().daemon_version() != "");
}
