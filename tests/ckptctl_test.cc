// ckptctl against a real ckptd: every subcommand's --json (numbers as numbers, levels as
// words), `jobs` (and who sees which job), the exit codes of things not found, and
// `status --watch` (frames, the progress of a shard held in flight by the publish pause,
// Ctrl-C, and the daemon going away).
#include <ckpt/client.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/run_as.h"
#include "support/shard_path.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

DaemonOptions Options(const TempDir& dir, std::vector<std::string> extra = {}) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = std::move(extra);
  return o;
}

ProcessResult Ctl(const std::string& socket, std::vector<std::string> args) {
  args.insert(args.begin(), {CKPTCTL_BINARY, "--socket", socket});
  return RunProcess(args);
}

// A run's stdout and stderr apart (RunProcess gives them together).
struct SplitResult {
  int exit_code = -1;
  std::string out, err;
};

SplitResult CtlSplit(const TempDir& dir, std::vector<std::string> args) {
  const std::string err_path = dir.path() + "/ckptctl.stderr";
  args.insert(args.begin(), {"/bin/sh", "-c", "exec \"$@\" 2>\"$0\"", err_path, CKPTCTL_BINARY});
  ProcessResult r = RunProcess(args);
  std::ifstream f(err_path);
  std::stringstream err;
  err << f.rdbuf();
  return {r.exit_code, r.output, err.str()};
}

// Whether every line of `text` starts with "ckptctl:", and there is at least one.
bool AllLinesPrefixed(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("ckptctl:", 0) != 0) return false;
    ++n;
  }
  return n > 0;
}

// The JSON a successful run printed.
json Json(const ProcessResult& r) {
  INFO("ckptctl said: " << r.output);
  REQUIRE(r.exit_code == 0);
  return json::parse(r.output);
}

bool Contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// One committed version of `job` (rank 0 of 1, 2 tensors of 256 KiB).
void CommitOne(const std::string& socket, const std::string& job, std::uint64_t version) {
  TrainerState state(2, 256 << 10);
  state.Fill(version);
  Client client = Client::connect(socket);
  client.register_items(job, 0, 1, state.Items());
  client.snapshot(version);
  client.wait_durable(version, Level::kCommitted, std::chrono::seconds(60));
}

}  // namespace

TEST_CASE("ckptctl --json: every subcommand prints JSON with numbers as numbers and levels as words",
          "[tools]") {
  TempDir dir("ctljson");
  DaemonProcess daemon(Options(dir));
  TrainerState state(2, 256 << 10);
  state.Fill(1);
  Client client = Client::connect(daemon.socket());
  client.register_items("ctl", 0, 1, state.Items());
  client.snapshot(1);
  client.wait_durable(1, Level::kCommitted, std::chrono::seconds(60));
  const std::string shard = ShardPath(daemon.root(), "ctl", 1, 0);

  json status = Json(Ctl(daemon.socket(), {"status", "--json"}));
  CHECK(status["pool_bytes"].is_number_unsigned());
  CHECK(status["pool_bytes"] == 64ull << 20);
  CHECK(status["uptime_s"].is_number());
  REQUIRE(status["clients"].size() == 1);
  CHECK(status["clients"][0]["tensor_bytes"] == 512u << 10);
  CHECK(status["clients"][0]["last_version"] == 1);
  REQUIRE(status["shards"].size() == 1);
  CHECK(status["shards"][0]["level"] == "committed");
  CHECK(status["shards"][0]["version"] == 1);
  CHECK(status["shards"][0]["total_bytes"].is_number_unsigned());
  CHECK(status["shards"][0]["in_flight"] == false);
  CHECK(status["shards"][0]["state"] == "committed");
  CHECK(status["versions_committed"] == 1);

  json ls = Json(Ctl(daemon.socket(), {"ls", "--job", "ctl", "--json"}));
  CHECK(ls["job"] == "ctl");
  CHECK(ls["latest"] == 1);
  REQUIRE(ls["versions"].size() == 1);
  CHECK(ls["versions"][0]["version"] == 1);
  CHECK(ls["versions"][0]["committed"] == true);
  CHECK(ls["versions"][0]["durable_ranks"] == json::array({0}));

  json jobs = Json(Ctl(daemon.socket(), {"jobs", "--json"}));
  REQUIRE(jobs["jobs"].size() == 1);
  const json& job = jobs["jobs"][0];
  CHECK(job["job"] == "ctl");
  CHECK(job["has_owner"] == true);
  CHECK(job["owner_uid"] == ::geteuid());
  CHECK(job["latest_committed"] == 1);
  CHECK(job["versions"] == 1);
  CHECK(job["committed_versions"] == 1);
  CHECK(job["bytes"] == fs::file_size(shard));
  CHECK(job["sessions"] == 1);

  json prefetch = Json(Ctl(daemon.socket(), {"prefetch", "--job", "ctl", "--json"}));
  CHECK(prefetch["job"] == "ctl");
  CHECK(prefetch["version"] == 1);
  CHECK(prefetch["bytes"].is_number_unsigned());

  json verify = Json(Ctl(daemon.socket(), {"verify", shard, "--json"}));
  CHECK(verify["ok"] == 1);
  CHECK(verify["failed"] == 0);
  CHECK(verify["shards"][0]["result"] == "ok");
  json by_tree = Json(Ctl(daemon.socket(), {"verify", "--root", daemon.root(), "--job", "ctl", "--json"}));
  CHECK(by_tree["shards"][0]["path"] == shard);

  json inspect = Json(Ctl(daemon.socket(), {"inspect", shard, "--json"}));
  REQUIRE(inspect["shards"].size() == 1);
  CHECK(inspect["shards"][0]["version"] == 1);
  CHECK(inspect["shards"][0]["world_size"] == 1);
  CHECK(inspect["shards"][0]["file_bytes"] == fs::file_size(shard));
  CHECK(inspect["shards"][0]["items"][0]["bytes"] == 256u << 10);

  // --watch --json: one object per line, a frame each.
  ProcessResult watch = Ctl(daemon.socket(), {"status", "--watch", "0.05", "--count", "2", "--json"});
  INFO(watch.output);
  REQUIRE(watch.exit_code == 0);
  std::istringstream lines(watch.output);
  std::string first, second;
  REQUIRE(std::getline(lines, first));
  REQUIRE(std::getline(lines, second));
  CHECK(json::parse(first)["throughput"].is_null());
  json later = json::parse(second);
  CHECK(later["throughput"]["interval_s"].is_number());
  CHECK(later["throughput"]["write_bytes_per_s"].is_number());
  CHECK(later["pool_bytes"] == 64ull << 20);
}

TEST_CASE(
    "ckptctl exit codes: 3 for a job, version or file not found, 2 for usage, 1 without a daemon, "
    "4 for a corrupt shard",
    "[tools]") {
  TempDir dir("ctlrc");
  DaemonProcess daemon(Options(dir));
  CommitOne(daemon.socket(), "there", 1);
  const std::string shard = ShardPath(daemon.root(), "there", 1, 0);

  auto ls = Ctl(daemon.socket(), {"ls", "--job", "nosuch"});
  CHECK(ls.exit_code == 3);
  CHECK(Contains(ls.output, "no job 'nosuch'"));
  CHECK(Ctl(daemon.socket(), {"ls", "--job", "nosuch", "--json"}).exit_code == 3);
  CHECK(Ctl(daemon.socket(), {"ls", "--job", "there"}).exit_code == 0);
  auto prefetch = Ctl(daemon.socket(), {"prefetch", "--job", "there", "--version", "9"});
  INFO(prefetch.output);
  CHECK(prefetch.exit_code == 3);

  for (const char* sub : {"verify", "inspect"}) {
    INFO(sub);
    auto missing = Ctl(daemon.socket(), {sub, dir.path() + "/no-such.safetensors"});
    CHECK(missing.exit_code == 3);
    CHECK(Contains(missing.output, "no-such.safetensors"));
    auto version = Ctl(daemon.socket(), {sub, "--root", daemon.root(), "--job", "there", "--version", "9"});
    CHECK(version.exit_code == 3);
    CHECK(Contains(version.output, "has no version 9"));
    auto job = Ctl(daemon.socket(), {sub, "--root", daemon.root(), "--job", "nosuch"});
    CHECK(job.exit_code == 3);
    CHECK(Contains(job.output, "no job 'nosuch'"));
    auto rank = Ctl(daemon.socket(), {sub, "--root", daemon.root(), "--job", "there", "--rank", "5"});
    CHECK(rank.exit_code == 3);
    CHECK(
        Ctl(daemon.socket(), {sub, "--root", daemon.root(), "--job", "there", "--version", "1"}).exit_code ==
        0);
  }

  // A corrupt shard: a flipped byte in the data.
  const std::string bad = dir.path() + "/bad.safetensors";
  fs::copy_file(shard, bad);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(bad) - 10));
    f.put('\x5a');
  }
  auto corrupt = Ctl(daemon.socket(), {"verify", bad});
  CHECK(corrupt.exit_code == 4);
  CHECK(Contains(corrupt.output, "FAILED"));

  CHECK(Ctl(daemon.socket(), {"ls"}).exit_code == 2);      // --job is required
  CHECK(Ctl(daemon.socket(), {"bogus"}).exit_code == 2);   // no such subcommand
  CHECK(Ctl(daemon.socket(), {"verify"}).exit_code == 2);  // nothing to verify
  CHECK(Ctl(daemon.socket(), {"--help"}).exit_code == 0);
  for (const char* sub : {"status", "jobs"}) {
    auto down = Ctl(dir.path() + "/nope.sock", {sub});
    CHECK(down.exit_code == 1);
    CHECK(Contains(down.output, "is ckptd running on " + dir.path() + "/nope.sock"));
  }
  CHECK(Ctl(dir.path() + "/nope.sock", {"status", "--watch", "--count", "2"}).exit_code == 1);
}

TEST_CASE("ckptctl --socket works after the subcommand as before it", "[tools]") {
  TempDir dir("ctlsockafter");
  DaemonProcess daemon(Options(dir));
  CommitOne(daemon.socket(), "there", 1);
  for (const char* sub : {"status", "jobs"}) {
    auto after = RunProcess({CKPTCTL_BINARY, sub, "--socket", daemon.socket(), "--json"});
    INFO(sub << ": " << after.output);
    CHECK(after.exit_code == 0);
  }
  auto ls = RunProcess({CKPTCTL_BINARY, "ls", "--job", "there", "--socket", daemon.socket(), "--json"});
  INFO(ls.output);
  CHECK(ls.exit_code == 0);
  CHECK(Contains(ls.output, "\"latest\": 1"));
  // The socket given after the subcommand is the one used.
  auto down = RunProcess({CKPTCTL_BINARY, "status", "--socket", dir.path() + "/nope.sock"});
  CHECK(down.exit_code == 1);
  CHECK(Contains(down.output, "is ckptd running on " + dir.path() + "/nope.sock"));
}

TEST_CASE("ckptctl usage errors go to stderr on a line starting with 'ckptctl:', --help is unchanged",
          "[tools]") {
  TempDir dir("ctlusage");
  for (const std::vector<std::string>& argv : std::vector<std::vector<std::string>>{
           {"ls"}, {"bogus"}, {"verify"}, {"status", "--count", "2"}, {"status", "--watch", "0"}}) {
    auto r = CtlSplit(dir, argv);
    INFO(argv[0] << ": stdout '" << r.out << "' stderr '" << r.err << "'");
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("ckptctl: ", 0) == 0);
  }
  CHECK(CtlSplit(dir, {"ls"}).err.rfind("ckptctl: --job is required\n", 0) == 0);
  auto help = CtlSplit(dir, {"--help"});
  CHECK(help.exit_code == 0);
  CHECK(help.err.empty());
  CHECK(help.out.rfind("ckptctl: inspect ckptd and its checkpoints\n", 0) == 0);
}

TEST_CASE("ckptctl verify: a missing or corrupt shard has its line on stdout and its error on stderr",
          "[tools]") {
  TempDir dir("ctlverifyerr");
  const std::string missing = dir.path() + "/nonexist";
  auto verify = CtlSplit(dir, {"verify", missing});
  CHECK(verify.exit_code == 3);
  CHECK(verify.out == "MISSING " + missing + "\n");
  CHECK(verify.err == "ckptctl: verify: " + missing + ": no such file\n");
  auto verify_json = CtlSplit(dir, {"verify", missing, "--json"});
  CHECK(verify_json.exit_code == 3);
  CHECK(json::parse(verify_json.out)["missing"] == 1);
  CHECK(verify_json.err == verify.err);

  DaemonProcess daemon(Options(dir));
  CommitOne(daemon.socket(), "there", 1);
  const std::string bad = dir.path() + "/bad.safetensors";
  fs::copy_file(ShardPath(daemon.root(), "there", 1, 0), bad);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(bad) - 10));
    f.put('\x5a');
  }
  auto corrupt = CtlSplit(dir, {"verify", bad});
  INFO("stdout '" << corrupt.out << "' stderr '" << corrupt.err << "'");
  CHECK(corrupt.exit_code == 4);
  CHECK(corrupt.out.rfind("FAILED", 0) == 0);
  CHECK(AllLinesPrefixed(corrupt.err));
}

TEST_CASE("ckptctl: a job id the daemon refuses (INVALID_ARGUMENT) is a usage error, exit 2", "[tools]") {
  TempDir dir("ctlinvalid");
  DaemonProcess daemon(Options(dir));
  for (const char* sub : {"ls", "prefetch"}) {
    auto r = CtlSplit(dir, {"--socket", daemon.socket(), sub, "--job", "../etc"});
    INFO(sub << ": stdout '" << r.out << "' stderr '" << r.err << "'");
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(AllLinesPrefixed(r.err));
    CHECK(Contains(r.err, "INVALID_ARGUMENT"));
  }
}

TEST_CASE(
    "ckptctl jobs lists a job once it exists, with its commit, other uids see only their own and their "
    "group's",
    "[tools][multi-user][root]") {
  if (::geteuid() != 0) {
    WARN("needs root to act as other uids (forked children that setuid); skipped");
    return;
  }
  constexpr uid_t kOwner = 65534, kOther = 65533, kStranger = 65532;
  constexpr gid_t kGroup = 4343;
  TempDir dir("ctljobs");
  fs::create_directories(dir.path() + "/sock");
  ::chmod(dir.path().c_str(), 0755);
  ::chmod((dir.path() + "/sock").c_str(), 0755);
  std::vector<std::string> allow = {"--socket-mode", "0666", "--job-group", std::to_string(kGroup)};
  for (uid_t u : {kOwner, kOther, kStranger}) allow.insert(allow.end(), {"--allow-uid", std::to_string(u)});
  DaemonProcess daemon(Options(dir, allow));
  auto as = [](uid_t uid, const std::vector<gid_t>& groups, const std::vector<std::string>& argv) {
    return RunAs(uid, argv, groups);
  };
  auto trainer = [&](const std::string& job) { return ToyTrainerArgs(daemon.socket(), job, 2); };
  auto jobs_of = [&](uid_t uid, std::vector<gid_t> groups) {
    auto r = as(uid, groups, {CKPTCTL_BINARY, "--socket", daemon.socket(), "jobs", "--json"});
    INFO("uid " << uid << ": " << r.output);
    REQUIRE(r.exit_code == 0);
    const json doc = json::parse(r.output);
    std::map<std::string, json> out;
    for (const auto& j : doc["jobs"]) out[j["job"].get<std::string>()] = j;
    return out;
  };

  CHECK(jobs_of(kOwner, {}).empty());
  // kOwner's private job, and one shared with kGroup (its first registrant is a member).
  REQUIRE(as(kOwner, {}, trainer("mine")).exit_code == 0);
  REQUIRE(as(kOwner, {kGroup}, trainer("ours")).exit_code == 0);
  REQUIRE(as(kOther, {}, trainer("theirs")).exit_code == 0);

  auto owner = jobs_of(kOwner, {});
  CHECK(owner.size() == 2);
  REQUIRE(owner.count("mine") == 1);
  CHECK(owner["mine"]["owner_uid"] == kOwner);
  CHECK(owner["mine"]["has_group"] == false);
  CHECK(owner["mine"]["latest_committed"] == 2);
  CHECK(owner["mine"]["versions"] == 2);
  CHECK(owner["mine"]["bytes"].get<std::uint64_t>() > 1u << 20);  // two versions of 1 MiB of state
  REQUIRE(owner.count("ours") == 1);
  CHECK(owner["ours"]["owner_gid"] == kGroup);
  CHECK(owner.count("theirs") == 0);

  auto other = jobs_of(kOther, {});
  CHECK(other.size() == 1);
  CHECK(other.count("theirs") == 1);
  auto member = jobs_of(kOther, {kGroup});  // the same uid, now a member of the group
  CHECK(member.size() == 2);
  CHECK(member.count("ours") == 1);
  CHECK(member.count("mine") == 0);
  CHECK(jobs_of(kStranger, {}).empty());
  auto root = jobs_of(0, {});
  CHECK(root.size() == 3);

  // The text form names the owner and says when nothing is visible.
  auto text = as(kStranger, {}, {CKPTCTL_BINARY, "--socket", daemon.socket(), "jobs"});
  CHECK(Contains(text.output, "(no jobs you may see)"));
  auto root_text = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "jobs"});
  CHECK(Contains(root_text.output, "uid 65534"));
}

TEST_CASE("ckptctl jobs: a job appears after its first commit with its version count", "[tools]") {
  TempDir dir("ctljobs1");
  DaemonProcess daemon(Options(dir));
  CHECK(Json(Ctl(daemon.socket(), {"jobs", "--json"}))["jobs"].empty());
  CommitOne(daemon.socket(), "a", 1);
  CommitOne(daemon.socket(), "a", 2);
  json jobs = Json(Ctl(daemon.socket(), {"jobs", "--json"}));
  REQUIRE(jobs["jobs"].size() == 1);
  CHECK(jobs["jobs"][0]["job"] == "a");
  CHECK(jobs["jobs"][0]["latest_committed"] == 2);
  CHECK(jobs["jobs"][0]["versions"] == 2);
  CHECK(jobs["jobs"][0]["sessions"] == 0);  // both clients are gone
  CHECK(jobs["jobs"][0]["bytes"] == fs::file_size(ShardPath(daemon.root(), "a", 1, 0)) +
                                        fs::file_size(ShardPath(daemon.root(), "a", 2, 0)));
}

TEST_CASE(
    "ckptctl status --watch: frames show a shard held in flight with its progress, Ctrl-C ends it with 0, "
    "the daemon going away with 1",
    "[tools]") {
  TempDir dir("ctlwatch");
  const std::string pause = dir.path() + "/pause";
  { std::ofstream(pause) << "hold"; }
  // Version 1's shard stops before it is published (written to its .tmp, not yet renamed).
  ::setenv("CKPTD_TEST_PAUSE", ("publish:1:" + pause).c_str(), 1);
  DaemonProcess daemon(Options(dir));
  ::unsetenv("CKPTD_TEST_PAUSE");
  TrainerState state(2, 256 << 10);
  state.Fill(1);
  Client client = Client::connect(daemon.socket());
  client.register_items("watch", 0, 1, state.Items());
  // Destroyed first: a failed check never leaves the shard (and the daemon's stop) held.
  struct Release {
    std::string pause;
    ~Release() { fs::remove(pause); }
  } release{pause};
  client.snapshot(1);
  client.wait_snapshot(1);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));

  ProcessResult watch = Ctl(daemon.socket(), {"status", "--watch", "0.1", "--count", "2"});
  INFO(watch.output);
  REQUIRE(watch.exit_code == 0);
  CHECK(watch.output.find("\x1b[") == std::string::npos);  // not a TTY: no redrawing
  // Two frames, one blank line apart.
  std::vector<std::string> frames;
  for (std::size_t at = 0; at != std::string::npos;) {
    const std::size_t next = watch.output.find("\n\nckptd ", at);
    frames.push_back(watch.output.substr(at, next == std::string::npos ? next : next + 1 - at));
    at = next == std::string::npos ? next : next + 2;
  }
  REQUIRE(frames.size() == 2);
  for (const auto& f : frames) {
    INFO(f);
    CHECK(f.rfind("ckptd ", 0) == 0);
    CHECK(Contains(f, "in flight (1)"));
    CHECK(Contains(f, "sessions (1)"));
    CHECK(Contains(f, "job watch"));
    CHECK(Contains(f, "captured  [####################] copied 100%  written 100%  of 512.0 KiB"));
    CHECK(Contains(f, "pool "));
    CHECK(Contains(f, "tiers "));
  }
  CHECK(Contains(frames[0], "throughput  (from the next frame on)"));
  CHECK(Contains(frames[1], "throughput  copy "));

  // Ctrl-C between frames: exit 0.
  const std::string log = dir.path() + "/watch.log";
  pid_t pid = StartProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status", "--watch", "0.05"}, log);
  REQUIRE(Eventually([&] { return Contains(ReadFile(log), "in flight (1)"); }));
  ::kill(pid, SIGINT);
  CHECK(WaitProcess(pid) == 0);

  fs::remove(pause);
  client.wait_durable(1, Level::kCommitted, std::chrono::seconds(60));
  json done = Json(Ctl(daemon.socket(), {"status", "--json"}));
  CHECK(done["shards"][0]["in_flight"] == false);

  // The daemon goes away: a message and 1.
  const std::string log2 = dir.path() + "/watch2.log";
  pid = StartProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status", "--watch", "0.05"}, log2);
  REQUIRE(Eventually([&] { return Contains(ReadFile(log2), "in flight (0)"); }));
  client.unregister();
  daemon.Stop();
  CHECK(WaitProcess(pid) == 1);
  CHECK(Contains(ReadFile(log2), "went away"));
}

TEST_CASE("ckptctl status --watch on a terminal redraws each frame in place", "[tools]") {
  TempDir dir("ctltty");
  DaemonProcess daemon(Options(dir));
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  REQUIRE(master >= 0);
  REQUIRE(::grantpt(master) == 0);
  REQUIRE(::unlockpt(master) == 0);
  const std::string slave_name = ::ptsname(master);
  pid_t pid = ::fork();
  if (pid == 0) {
    const int slave = ::open(slave_name.c_str(), O_RDWR);
    if (slave < 0) ::_exit(126);
    ::dup2(slave, 1);
    ::execl(CKPTCTL_BINARY, CKPTCTL_BINARY, "--socket", daemon.socket().c_str(), "status", "--watch", "0.05",
            "--count", "2", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Read until the child exits and the terminal has nothing more (EIO once no one holds it).
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(master);
  CHECK(WaitProcess(pid) == 0);
  INFO(out);
  std::size_t clears = 0;
  for (std::size_t at = out.find("\x1b[H\x1b[2J"); at != std::string::npos;
       at = out.find("\x1b[H\x1b[2J", at + 1))
    ++clears;
  CHECK(clears == 2);
  CHECK(out.find("\r\n\r\nckptd ") == std::string::npos);  // no blank line between frames: drawn over
}
