// The fault matrix (issue 12): a real daemon whose storage fails on one file of the commit
// protocol (the CKPTD_TEST_FAULT seam, daemon/io/fault_storage.h) under a trainer that uses
// the client library. For each file (data, header, done marker, registration, COMMITTED,
// latest) and each fault (ENOSPC, EIO, EROFS on a write, a short write, EIO on fdatasync and
// rename, EROFS on create), and for slow storage, it checks:
//   - the failure reaches the trainer and `ckptctl status`;
//   - no committed version is lost (version 1, committed before the fault, keeps its bytes);
//   - nothing is left half-written (no .tmp, every shard verifies, every COMMITTED version
//     is complete, `latest` names a committed version);
//   - the daemon serves on, and commits again once the fault is removed (without a restart).
// Each case takes about a second. With CKPT_FAULT_MATRIX_OUT=FILE each case appends its row
// of the table in docs/FAULTS.md to FILE.
#include <ckpt/client.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr char kJob[] = "job";
constexpr auto kWait = std::chrono::seconds(30);
constexpr char kInjected[] = "injected by CKPTD_TEST_FAULT";

struct Fault {
  std::string op;     // write, datasync, rename, create
  std::string fault;  // ENOSPC, EIO, EROFS, short, slow
};

// The faults every file of the protocol gets.
const Fault kFaults[] = {{"write", "ENOSPC"}, {"write", "EIO"},  {"write", "EROFS"}, {"write", "short"},
                         {"datasync", "EIO"}, {"rename", "EIO"}, {"create", "EROFS"}};

std::string FirstLine(std::string s) {
  if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  for (auto& c : s) {
    if (c == '|') c = '/';  // a markdown table cell
  }
  return s;
}

std::uint64_t ReadLatestFile(const std::string& root) {
  std::ifstream in(root + "/" + kJob + "/latest");
  std::uint64_t v = 0;
  in >> v;
  return v;
}

// Nothing half-written: no temporary file, every shard verifies, every COMMITTED version
// has its shard and a node marker, `latest` names a committed version.
void CheckTree(const std::string& root) {
  for (const auto& f : ListFiles(root)) {
    INFO(f);
    CHECK(f.find(".tmp") == std::string::npos);
    if (f.ends_with(".safetensors")) CHECK(VerifyShard(root + "/" + f).ok());
    if (f.ends_with("/COMMITTED")) {
      const std::string vdir = root + "/" + f.substr(0, f.size() - std::string("/COMMITTED").size());
      CHECK(VerifyShard(vdir + "/" + ShardFileName(0)).ok());
      bool marker = false;
      for (const auto& e : fs::directory_iterator(vdir))
        marker |= ParseNodeMarkerName(e.path().filename().string()).has_value();
      CHECK(marker);
    }
  }
  const std::string job_dir = root + "/" + kJob;
  if (fs::exists(job_dir + "/latest")) {
    CHECK(fs::exists(job_dir + "/" + VersionDirName(ReadLatestFile(root)) + "/COMMITTED"));
  }
}

// Version 1 (committed before any fault) is still committed, with its own bytes.
void CheckVersion1(const std::string& root, const TrainerState& state) {
  const std::string vdir = root + "/" + kJob + "/" + VersionDirName(1);
  REQUIRE(fs::exists(vdir + "/COMMITTED"));
  const std::string shard = vdir + "/" + ShardFileName(0);
  REQUIRE(VerifyShard(shard).ok());
  for (std::size_t t = 0; t < state.tensors(); ++t) {
    CHECK(ReadShardItem(shard, "t" + std::to_string(t)) == state.Expected(t, 1));
  }
}

// `ckptctl status`, whose exit code says whether a shard it lists is FAILED (5) or not (0).
std::string CkptctlStatus(const DaemonProcess& daemon) {
  auto r = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status"});
  INFO(r.output);
  const bool failed_listed = r.output.find(" FAILED ") != std::string::npos;
  REQUIRE(r.exit_code == (failed_listed ? 5 : 0));
  return r.output;
}

// The line of the errors `ckptctl status` shows that names the injected fault, or "".
std::string StatusError(const std::string& status) {
  auto errors = status.find("\nerrors (");
  if (errors == std::string::npos) return "";
  auto at = status.find(kInjected, errors);
  if (at == std::string::npos) return "";
  auto begin = status.rfind('\n', at);
  begin = begin == std::string::npos ? 0 : begin + 1;
  auto end = status.find('\n', at);
  std::string line = status.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  line.erase(0, line.find_first_not_of(' '));
  return line;
}

void Record(const std::string& file, const Fault& f, const std::string& saw, const std::string& status,
            const std::string& outcome) {
  const char* out = std::getenv("CKPT_FAULT_MATRIX_OUT");
  if (out == nullptr) return;
  std::ofstream(out, std::ios::app) << "| " << file << " | " << f.fault << " on " << f.op << " | "
                                    << FirstLine(saw) << " | " << FirstLine(status) << " | " << outcome
                                    << " |\n";
}

struct Armed {
  TempDir dir{"fault"};
  std::string armed = dir.path() + "/armed";
  DaemonOptions options;
};

std::unique_ptr<DaemonProcess> StartFaulty(Armed& a, const std::string& file, const Fault& f,
                                           const std::string& extra = "") {
  a.options.root = a.dir.path() + "/root";
  if (extra.find("under=") != std::string::npos) a.options.extra_args = {"--local", a.dir.path() + "/local"};
  a.options.socket = a.dir.path() + "/sock/ckptd.sock";
  const std::string spec = "file=" + file + ",op=" + f.op + ",fault=" + f.fault + ",while=" + a.armed + extra;
  ::setenv("CKPTD_TEST_FAULT", spec.c_str(), 1);
  auto daemon = std::make_unique<DaemonProcess>(a.options);
  ::unsetenv("CKPTD_TEST_FAULT");
  return daemon;
}

// SIGTERM, and the daemon must exit 0 (a sanitizer's report makes it fail): its log if not.
void StopCleanly(DaemonProcess& daemon) {
  const int rc = daemon.Stop();
  INFO(daemon.Log());
  CHECK(rc == 0);
}

void Arm(const Armed& a) { std::ofstream(a.armed) << "armed"; }
void Disarm(const Armed& a) { fs::remove(a.armed); }

// Commits `version` and checks that a restore in place gives back its bytes.
void CommitAndRestore(Client& c, TrainerState& state, std::uint64_t version) {
  state.Fill(version);
  c.snapshot(version);
  c.wait_durable(version, Level::kCommitted, kWait);
  state.Fill(999);
  CHECK(c.restore().version == version);
  CHECK(state.FirstMismatch(version) == -1);
}

// A fault on a file written for a version (data, header, done marker, COMMITTED): that
// version fails, and the trainer hears why from its wait.
// `promotion`: with a local tier, the fault hits only the persistent tier's copy.
void VersionFails(const std::string& file, const Fault& f, bool promotion = false) {
  Armed a;
  auto daemon = StartFaulty(a, file, f, promotion ? ",under=" + a.dir.path() + "/root" : "");
  // A promotion copies in pieces, the first holding the header and the start of the data
  // (a write at offset 0: the header's); its data needs more than one piece.
  TrainerState state(2, promotion ? 4 << 20 : 64 << 10, 7);
  std::optional<Client> c = Client::connect(daemon->socket());
  c->register_items(kJob, 0, 1, state.Items());
  state.Fill(1);
  c->snapshot(1);
  c->wait_durable(1, Level::kCommitted, kWait);

  Arm(a);
  state.Fill(2);
  c->snapshot(2);
  std::string saw;
  try {
    c->wait_durable(2, Level::kCommitted, kWait);
  } catch (const Error& e) {
    saw = e.what();
  }
  INFO(saw);
  CHECK(saw.find(kInjected) != std::string::npos);
  // The caller may hear of the failure (a shard's waiters wake when it fails) a moment before
  // the daemon adds it to the errors `ckptctl status` shows.
  std::string status;
  CHECK(Eventually([&] { return !(status = StatusError(CkptctlStatus(*daemon))).empty(); },
                   std::chrono::seconds(10)));
  CHECK(!fs::exists(a.options.root + "/" + kJob + "/" + VersionDirName(2) + "/COMMITTED"));
  CHECK(ReadLatestFile(a.options.root) == 1);
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);
  if (promotion) {
    for (const auto& f : ListFiles(a.dir.path() + "/local")) CHECK(f.find(".tmp") == std::string::npos);
  }

  Disarm(a);
  CommitAndRestore(*c, state, 3);
  CHECK(ReadLatestFile(a.options.root) == 3);
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);
  c.reset();  // disconnected: the daemon stops at once
  StopCleanly(*daemon);
  Record(promotion ? "data (promotion from --local)" : file, f, saw, status,
         "version 2 failed; 1 kept; 3 committed after the fault");
}

// A fault on the registration file: a restarted trainer's registration fails, and the one
// after the fault registers and commits.
void RegistrationFails(const Fault& f) {
  Armed a;
  auto daemon = StartFaulty(a, "ranks", f);
  TrainerState state(2, 64 << 10, 7);
  {
    Client c = Client::connect(daemon->socket());
    c.register_items(kJob, 0, 1, state.Items());
    state.Fill(1);
    c.snapshot(1);
    c.wait_durable(1, Level::kCommitted, kWait);
  }  // the trainer exits (unregisters)

  Arm(a);
  std::string saw;
  try {
    Client c = Client::connect(daemon->socket());
    c.register_items(kJob, 0, 1, state.Items());
  } catch (const Error& e) {
    saw = e.what();
  }
  INFO(saw);
  CHECK(saw.find(kInjected) != std::string::npos);
  // The caller may hear of the failure (a shard's waiters wake when it fails) a moment before
  // the daemon adds it to the errors `ckptctl status` shows.
  std::string status;
  CHECK(Eventually([&] { return !(status = StatusError(CkptctlStatus(*daemon))).empty(); },
                   std::chrono::seconds(10)));
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);

  Disarm(a);
  std::optional<Client> c = Client::connect(daemon->socket());
  CHECK(c->register_items(kJob, 0, 1, state.Items()).latest_committed == 1);
  CommitAndRestore(*c, state, 2);
  CHECK(ReadLatestFile(a.options.root) == 2);
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);
  c.reset();
  StopCleanly(*daemon);
  Record("ranks", f, saw, status, "registration failed; 1 kept; registered and 2 committed after the fault");
}

// A fault on `latest`: the version is committed (COMMITTED is durable, and every reader
// takes the newest COMMITTED), so the wait succeeds; the stale pointer is reported, the
// daemon's own view is right, and the file is repaired once the fault is gone.
void LatestStale(const Fault& f) {
  Armed a;
  auto daemon = StartFaulty(a, "latest", f);
  TrainerState state(2, 64 << 10, 7);
  std::optional<Client> c = Client::connect(daemon->socket());
  c->register_items(kJob, 0, 1, state.Items());
  state.Fill(1);
  c->snapshot(1);
  c->wait_durable(1, Level::kCommitted, kWait);

  Arm(a);
  state.Fill(2);
  c->snapshot(2);
  std::string saw = "OK";
  try {
    c->wait_durable(2, Level::kCommitted, kWait);
  } catch (const Error& e) {
    saw = e.what();
  }
  CHECK(saw == "OK");
  CHECK(fs::exists(a.options.root + "/" + kJob + "/" + VersionDirName(2) + "/COMMITTED"));
  const std::string status = StatusError(CkptctlStatus(*daemon));
  INFO(status);
  CHECK(status.find("latest") != std::string::npos);
  CHECK(ReadLatestFile(a.options.root) == 1);  // stale, but whole
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);
  // The trainer restarts: the daemon tells it the truth, not the stale file.
  c.reset();
  c = Client::connect(daemon->socket());
  CHECK(c->register_items(kJob, 0, 1, state.Items()).latest_committed == 2);

  Disarm(a);
  // Repaired without waiting for another commit.
  CHECK(Eventually([&] { return ReadLatestFile(a.options.root) == 2; }, std::chrono::seconds(10)));
  CheckTree(a.options.root);
  CommitAndRestore(*c, state, 3);
  CHECK(ReadLatestFile(a.options.root) == 3);
  CheckTree(a.options.root);
  CheckVersion1(a.options.root, state);
  c.reset();
  StopCleanly(*daemon);
  Record(
      "latest", f, saw + " (version 2 committed)", status,
      "2 committed, `latest` said 1 until the fault went, then repaired to 2 without a commit; 3 committed");
}

void RunFile(const std::string& file) {
  for (const Fault& f : kFaults) {
    if (file == "header" && f.op != "write") continue;  // one file with the data: same calls
    DYNAMIC_SECTION(file << ": " << f.fault << " on " << f.op) {
      if (file == "ranks") {
        RegistrationFails(f);
      } else if (file == "latest") {
        LatestStale(f);
      } else {
        VersionFails(file, f);
      }
    }
  }
}

}  // namespace

TEST_CASE("fault matrix: shard data", "[faults]") { RunFile("data"); }
TEST_CASE("fault matrix: shard header", "[faults]") { RunFile("header"); }
TEST_CASE("fault matrix: done marker", "[faults]") { RunFile("done"); }
TEST_CASE("fault matrix: registration file", "[faults]") { RunFile("ranks"); }
TEST_CASE("fault matrix: COMMITTED", "[faults]") { RunFile("committed"); }
TEST_CASE("fault matrix: latest", "[faults]") { RunFile("latest"); }

TEST_CASE("fault matrix: promotion from the local tier", "[faults]") {
  for (const Fault& f : kFaults) {
    DYNAMIC_SECTION("promoted data: " << f.fault << " on " << f.op) {
      VersionFails("data", f, /*promotion=*/true);
    }
  }
}

TEST_CASE("fault matrix: slow storage", "[faults]") {
  SECTION("a slow fdatasync of COMMITTED: a wait times out, the version commits, nothing fails") {
    Armed a;
    const Fault f{"datasync", "slow"};
    auto daemon = StartFaulty(a, "committed", f, ",delay_ms=1500");
    TrainerState state(2, 64 << 10, 7);
    std::optional<Client> c = Client::connect(daemon->socket());
    c->register_items(kJob, 0, 1, state.Items());
    Arm(a);
    state.Fill(1);
    c->snapshot(1);
    c->wait_snapshot(1);
    std::string saw = "OK";
    try {
      c->wait_durable(1, Level::kCommitted, std::chrono::milliseconds(200));
    } catch (const Error& e) {
      saw = e.what();
      CHECK(e.code() == 4);  // DEADLINE_EXCEEDED: the wait ended, the version did not fail
    }
    CHECK(saw != "OK");
    c->wait_durable(1, Level::kCommitted, kWait);
    Disarm(a);
    CHECK(StatusError(CkptctlStatus(*daemon)).empty());
    CommitAndRestore(*c, state, 2);
    CheckTree(a.options.root);
    CheckVersion1(a.options.root, state);
    c.reset();
    StopCleanly(*daemon);
    Record("committed", f, "wait_durable(200 ms): " + saw + "; then OK", "no error",
           "1 committed 1.5 s late; 2 committed");
  }
  SECTION("slow data writes through a small pool: backpressure, every version commits") {
    Armed a;
    const Fault f{"write", "slow"};
    a.options.pool_mib = 16;
    a.options.chunk_mib = 4;
    auto daemon = StartFaulty(a, "data", f, ",delay_ms=50");
    TrainerState state(8, 4 << 20, 7);  // 32 MiB through a 16 MiB pool
    std::optional<Client> c = Client::connect(daemon->socket());
    c->register_items(kJob, 0, 1, state.Items());
    state.Fill(1);
    c->snapshot(1);
    c->wait_durable(1, Level::kCommitted, kWait);
    Arm(a);
    for (std::uint64_t v = 2; v <= 3; ++v) {
      state.Fill(v);
      c->snapshot(v);
      c->wait_snapshot(v);
    }
    c->wait_durable(3, Level::kCommitted, kWait);
    c->wait_durable(2, Level::kCommitted, kWait);
    Disarm(a);
    CHECK(StatusError(CkptctlStatus(*daemon)).empty());
    CommitAndRestore(*c, state, 4);
    CheckTree(a.options.root);
    CheckVersion1(a.options.root, state);
    c.reset();
    StopCleanly(*daemon);
    Record("data", f, "OK (waits longer)", "no error", "2, 3, 4 committed");
  }
}
