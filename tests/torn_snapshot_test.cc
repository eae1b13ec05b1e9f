// Torn snapshots against a real ckptd: a version whose memory changed between snapshot(v)
// and the end of its copy is aborted, never committed, and the previous committed version
// stays restorable byte for byte. Sealed registrations publish a version only once the
// client vouched for it; verify mode has the daemon check the client's word.
#include <ckpt/client.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <random>
#include <string>

#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/shard_path.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

DaemonOptions Options(const TempDir& dir, std::vector<std::string> extra = {}) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.pool_mib = 64;
  o.chunk_mib = 1;
  o.extra_args = std::move(extra);
  return o;
}

const v1::VersionInfo* FindVersion(const v1::ListReply& list, std::uint64_t v) {
  for (const auto& info : list.versions()) {
    if (info.version() == v) return &info;
  }
  return nullptr;
}

const v1::ShardStatus* FindShard(const v1::StatusReply& s, const std::string& job, std::uint64_t v) {
  for (const auto& sh : s.shards()) {
    if (sh.job() == job && sh.version() == v) return &sh;
  }
  return nullptr;
}

RegisterOptions Verify() {
  RegisterOptions o;
  o.verify = true;
  return o;
}

RegisterOptions Sealed() {
  RegisterOptions o;
  o.sealed = true;
  return o;
}

// Changes one byte of tensor `t` of `state` in place (a write the trainer must not make
// before its wait).
void Scribble(const TrainerState& state, std::size_t t, std::size_t at) {
  auto* p = static_cast<unsigned char*>(state.region()->data()) + t * state.tensor_bytes() + at;
  *p = static_cast<unsigned char>(*p ^ 0x5a);
}

}  // namespace

TEST_CASE("verify mode: memory changed after its copy aborts the version, naming the item and bytes",
          "[torn]") {
  TempDir dir("torn-verify");
  DaemonProcess daemon(Options(dir));
  TrainerState state(4, 3 << 20);  // 12 MiB in 1 MiB chunks: several pieces per item
  Client client = Client::connect(daemon.socket());
  Registration reg = client.register_items("tv", 0, 1, state.Items(), Verify());
  CHECK(reg.verify);
  CHECK(reg.sealed);

  state.Fill(1);
  client.snapshot(1);
  client.wait_snapshot(1);
  client.wait_durable(1);

  state.Fill(2);
  client.snapshot(2);
  client.wait_snapshot(2, std::chrono::milliseconds(0), /*seal=*/false);  // captured, not sealed
  Scribble(state, 2, (3 << 20) - 5);  // the last piece of t2
  try {
    client.wait_snapshot(2);
    FAIL("the sealing wait did not notice the change");
  } catch (const TornSnapshotError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(e.version() == 2);
    CHECK(e.code() == 10);
    CHECK(msg.find("item 't2'") != std::string::npos);
    CHECK(msg.find("bytes [2097152, 3145728) of its 3145728 differ") != std::string::npos);
    CHECK(msg.find("never committed") != std::string::npos);
  }
  // Every later wait on it says so too; nothing of it commits.
  CHECK_THROWS_AS(client.wait_durable(2), TornSnapshotError);
  const v1::ListReply list = daemon.List("tv");
  CHECK(list.latest() == 1);
  const v1::VersionInfo* v2 = FindVersion(list, 2);
  REQUIRE(v2 != nullptr);
  CHECK_FALSE(v2->committed());
  CHECK(v2->aborted());
  CHECK(v2->abort_reason().find("rank 0: torn snapshot: item 't2'") == 0);
  CHECK(v2->durable_ranks().empty());
  CHECK_FALSE(fs::exists(ShardPath(daemon.root(), "tv", 2, 0)));
  const v1::ShardStatus* shard = FindShard(daemon.Status(), "tv", 2);
  REQUIRE(shard != nullptr);
  CHECK(shard->aborted());

  // Training goes on: the next version is taken (the abort is not reported again) and commits.
  state.Fill(3);
  client.snapshot(3);
  client.wait_snapshot(3);
  client.wait_durable(3);
  CHECK(daemon.List("tv").latest() == 3);
  CHECK(ReadShardItem(ShardPath(daemon.root(), "tv", 3, 0), "t2") == state.Expected(2, 3));
}

TEST_CASE("verify mode: an aborted version leaves the previous one restorable byte for byte", "[torn]") {
  TempDir dir("torn-restore");
  DaemonProcess daemon(Options(dir));
  TrainerState state(3, 1 << 20);
  {
    Client client = Client::connect(daemon.socket());
    client.register_items("tr", 0, 1, state.Items(), Verify());
    state.Fill(1);
    client.snapshot(1);
    client.wait_snapshot(1);
    client.wait_durable(1);
    state.Fill(2);
    client.snapshot(2);
    client.wait_snapshot(2, std::chrono::milliseconds(0), false);
    Scribble(state, 0, 17);
    CHECK_THROWS_AS(client.wait_snapshot(2), TornSnapshotError);
  }
  state.Fill(9);  // the restarted trainer's memory holds something else
  Client client = Client::connect(daemon.socket());
  client.register_items("tr", 0, 1, state.Items(), Verify());
  RestoreResult r = client.restore();
  CHECK(r.version == 1);
  CHECK(state.FirstMismatch(1) == -1);
}

TEST_CASE("ckptd --verify-snapshots verifies a registration that did not ask", "[torn]") {
  TempDir dir("torn-forced");
  DaemonProcess daemon(Options(dir, {"--verify-snapshots"}));
  TrainerState state(2, 1 << 20);
  Client client = Client::connect(daemon.socket());
  Registration reg = client.register_items("tf", 0, 1, state.Items());
  CHECK(reg.verify);
  state.Fill(1);
  client.snapshot(1);
  client.wait_snapshot(1, std::chrono::milliseconds(0), false);
  Scribble(state, 1, 0);
  CHECK_THROWS_WITH(client.wait_snapshot(1), Catch::Contains("item 't1'"));
  CHECK(daemon.List("tf").latest() == 0);
}

TEST_CASE("sealed: abort_snapshot drops the version with the trainer's reason", "[torn]") {
  TempDir dir("torn-abort");
  DaemonProcess daemon(Options(dir));
  TrainerState state(2, 1 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("ta", 0, 1, state.Items(), Sealed());
  state.Fill(1);
  client.snapshot(1);
  client.wait_snapshot(1);
  client.wait_durable(1);

  state.Fill(2);
  client.snapshot(2);
  client.wait_snapshot(2, std::chrono::milliseconds(0), false);
  // A reason too long is refused and changes nothing: the version can still be aborted.
  CHECK_THROWS_WITH(client.abort_snapshot(2, std::string(1025, 'x')), Catch::Contains("at most 1024"));
  client.abort_snapshot(2, "tensor model.bn.running_mean changed after save(2)");
  client.abort_snapshot(2, "twice is harmless");
  CHECK_THROWS_WITH(client.wait_durable(2), Catch::Contains("model.bn.running_mean changed after save(2)"));
  const v1::ListReply list = daemon.List("ta");
  const v1::VersionInfo* v2 = FindVersion(list, 2);
  REQUIRE(v2 != nullptr);
  CHECK(v2->aborted());
  CHECK(v2->abort_reason() == "rank 0: torn snapshot: tensor model.bn.running_mean changed after save(2)");

  // A sealed version cannot be aborted any more.
  state.Fill(3);
  client.snapshot(3);
  client.wait_snapshot(3);
  try {
    client.abort_snapshot(3, "too late");
    FAIL("a sealed version was aborted");
  } catch (const Error& e) {
    CHECK(e.code() == 9);
    CHECK_THAT(e.what(), Catch::Contains("was sealed by an earlier wait"));
  }
  client.wait_durable(3);
  CHECK(daemon.List("ta").latest() == 3);
}

TEST_CASE("sealed: the next snapshot is refused while the last one is neither sealed nor aborted", "[torn]") {
  TempDir dir("torn-order");
  DaemonProcess daemon(Options(dir));
  TrainerState state(1, 1 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("to", 0, 1, state.Items(), Sealed());
  client.snapshot(1);
  client.wait_snapshot(1, std::chrono::milliseconds(0), false);
  CHECK_THROWS_WITH(client.snapshot(2), Catch::Contains("version 1 is not sealed yet: call wait_snapshot(1)"));
  client.wait_snapshot(1);
  client.snapshot(2);  // taken now
  client.wait_snapshot(2);
  client.wait_durable(2);
}

TEST_CASE("abort_snapshot on a registration that does not seal is refused, naming the option", "[torn]") {
  TempDir dir("torn-plain");
  DaemonProcess daemon(Options(dir));
  TrainerState state(1, 1 << 20);
  Client client = Client::connect(daemon.socket());
  client.register_items("tp", 0, 1, state.Items());
  client.snapshot(1);
  CHECK_THROWS_WITH(client.abort_snapshot(1, "x"), Catch::Contains("register with sealed"));
  CHECK_THROWS_WITH(client.abort_snapshot(7, "x"), Catch::Contains("version 7 was not snapshotted"));
  client.wait_snapshot(1);
  client.wait_durable(1);  // the refused abort changed nothing
}

TEST_CASE("verify mode: a trainer killed between snapshot and wait loses only that version", "[torn]") {
  TempDir dir("torn-kill");
  DaemonProcess daemon(Options(dir));
  const std::vector<std::string> base = {TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "tk",
                                         "--state-mib", "4", "--tensors", "2", "--compute-ms", "1", "--verify"};
  auto args = base;
  args.insert(args.end(), {"--iters", "10", "--crash-at", "3"});
  ProcessResult crashed = RunProcess(args);
  INFO(crashed.output);
  REQUIRE(crashed.exit_code == 128 + SIGKILL);
  // Version 3 was captured but never vouched for by its wait: the restart restores 2.
  args = base;
  args.insert(args.end(), {"--iters", "2", "--resume"});  // restores, takes no new version
  ProcessResult resumed = RunProcess(args);
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.output.find("restored version 2 from memory") != std::string::npos);
  const v1::ListReply list = daemon.List("tk");
  const v1::VersionInfo* v3 = FindVersion(list, 3);
  REQUIRE(v3 != nullptr);
  CHECK(v3->aborted());
  CHECK_THAT(v3->abort_reason(), Catch::Contains("exited before it sealed version 3"));
  CHECK_FALSE(fs::exists(ShardPath(daemon.root(), "tk", 3, 0)));
  CHECK(list.latest() == 2);
}

TEST_CASE("verify mode: the toy trainer's torn version is aborted and training goes on", "[torn]") {
  TempDir dir("torn-toy");
  DaemonProcess daemon(Options(dir));
  ProcessResult r = RunProcess({TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "tt", "--state-mib", "4",
                                "--tensors", "2", "--compute-ms", "1", "--iters", "6", "--verify", "--tear-at", "3",
                                "--keep-going"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("version error (code 10): wait_snapshot 3: ") != std::string::npos);
  CHECK(r.output.find("item 'layer0.weight' changed between snapshot(3) and its wait: bytes [0, ") !=
        std::string::npos);
  const v1::ListReply list = daemon.List("tt");
  CHECK(list.latest() == 6);
  for (std::uint64_t v = 1; v <= 6; ++v) {
    INFO("version " << v);
    const v1::VersionInfo* info = FindVersion(list, v);
    REQUIRE(info != nullptr);
    CHECK(info->committed() == (v != 3));
    CHECK(info->aborted() == (v == 3));
  }
}

TEST_CASE("verify mode: kill -9 at random steps, every resume is the exact state of the step before",
          "[torn]") {
  TempDir dir("torn-random");
  DaemonProcess daemon(Options(dir));
  const unsigned seed = static_cast<unsigned>(std::random_device{}());
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::uint64_t committed = 0;
  for (int trial = 0; trial < 4; ++trial) {
    const std::uint64_t crash = committed + 2 + rng() % 5;  // at least one new version each time
    INFO("trial " << trial << ": crash at " << crash);
    std::vector<std::string> args = {TOY_TRAINER_BINARY, "--socket", daemon.socket(), "--job", "rnd",
                                     "--state-mib", "4", "--tensors", "3", "--compute-ms", "1", "--verify",
                                     "--iters", "100", "--crash-at", std::to_string(crash)};
    if (committed > 0) args.push_back("--resume");
    ProcessResult r = RunProcess(args);
    INFO(r.output);
    REQUIRE(r.exit_code == 128 + SIGKILL);
    if (committed > 0) {
      // The resume checked every byte against the state of the version it restored.
      CHECK(r.output.find("restored version " + std::to_string(committed) + " from") != std::string::npos);
      CHECK(r.output.find("every byte verified") != std::string::npos);
    }
    // The crashed version was never sealed: aborted once the daemon sees its trainer gone
    // (the reaper looks every 250 ms), never committed; the one before it is the newest.
    REQUIRE(Eventually([&] {
      const v1::ListReply list = daemon.List("rnd");
      const v1::VersionInfo* torn = FindVersion(list, crash);
      return torn != nullptr && torn->aborted();
    }));
    const v1::ListReply list = daemon.List("rnd");
    CHECK_FALSE(FindVersion(list, crash)->committed());
    committed = crash - 1;
    REQUIRE(Eventually([&] { return daemon.List("rnd").latest() == committed; }));
  }
}
