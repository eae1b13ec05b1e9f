// Versions commit even out of order: a version whose shards become durable after a newer
// version committed still commits (`latest` never moves back), and its waits return.
// Before, it silently never committed and wait_durable on it blocked for ever (issue 12,
// defect 13; an independent PyTorch run saw up to 13 of 200 versions lost this way).
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/peer_cluster.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {}  // namespace

TEST_CASE("a version made durable after a newer one committed still commits", "[commit]") {
  TempDir dir("order");
  const std::string pause = dir.path() + "/pause";
  { std::ofstream(pause) << "hold"; }
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  // Version 1's shard stops before it is published, for as long as `pause` exists.
  ::setenv("CKPTD_TEST_PAUSE", ("publish:1:" + pause).c_str(), 1);
  DaemonProcess daemon(o);
  ::unsetenv("CKPTD_TEST_PAUSE");

  TrainerState state(2, 256 << 10, 3);
  Client c = Client::connect(daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  state.Fill(1);
  c.snapshot(1);
  c.wait_snapshot(1);
  REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  state.Fill(2);
  c.snapshot(2);
  c.wait_durable(2, Level::kCommitted, std::chrono::seconds(60));
  const std::string job_dir = o.root + "/job/";
  REQUIRE(fs::exists(job_dir + VersionDirName(2) + "/COMMITTED"));

  fs::remove(pause);  // version 1 goes on
  c.wait_durable(1, Level::kCommitted, std::chrono::seconds(60));
  CHECK(fs::exists(job_dir + VersionDirName(1) + "/COMMITTED"));
  CHECK(ReadFile(job_dir + "latest").find('2') != std::string::npos);  // never moves back
  CHECK(VerifyShard(job_dir + VersionDirName(1) + "/" + ShardFileName(0)).ok());
  // It restores with its own bytes (a rollback from 2).
  CHECK(c.restore(1).version == 1);
  CHECK(state.FirstMismatch(1) == -1);
}

// A rollback is made on the shared directory by the daemon of the first rank that restores;
// the other daemons of the job find no newer version there, yet hold their own state of the
// versions set aside. The numbers above the restored version commit again, on every daemon,
// and hold the new timeline's contents.
TEST_CASE("after a rollback made by another daemon, a version number used again commits with its new contents",
          "[commit][rollback]") {
  TempDir dir("rollback");
  Cluster c(dir, 2, 0);  // 2 daemons, no replicas: rank r on node r / 2
  c.StartAll();
  Job job("rollback", 4);
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    job.Snapshot(v);
    for (auto& r : job.ranks) r->client->wait_durable(v, Level::kCommitted, std::chrono::seconds(30));
  }
  // The job restarts from version 2: rank 0's daemon sets version 3 aside, rank 2's finds it gone.
  job.Launch(c);
  for (auto& r : job.ranks) {
    r->state.Fill(999);
    REQUIRE(r->client->restore(2).version == 2);
    CHECK(r->state.FirstMismatch(2) == -1);
  }
  // Version 3 again, with other contents: it commits on both daemons.
  for (auto& r : job.ranks) {
    r->state.Fill(303);
    r->client->snapshot(3);
  }
  for (auto& r : job.ranks) {
    INFO("rank " << r->rank);
    r->client->wait_durable(3, Level::kCommitted, std::chrono::seconds(30));
  }
  const std::string job_dir = c.root() + "/rollback/";
  CHECK(fs::exists(job_dir + "set-aside/" + VersionDirName(3) + "/COMMITTED"));  // the timeline left
  CHECK(ReadFile(job_dir + "latest").find('3') != std::string::npos);
  // A restart restores the new version 3 on every rank: from the daemons' tiers, then, with
  // both nodes lost, from the persistent tier.
  for (bool lost : {false, true}) {
    if (lost) {
      job.ranks.clear();
      for (int i = 0; i < 2; ++i) c.Lose(i);
      c.StartAll();
    }
    job.Launch(c);
    for (auto& r : job.ranks) {
      INFO("rank " << r->rank << (lost ? ", nodes lost" : ""));
      r->state.Fill(999);
      RestoreResult got = r->client->restore();
      REQUIRE(got.version == 3);
      if (lost) CHECK(got.tier == "persistent");
      CHECK(r->state.FirstMismatch(303) == -1);
    }
  }
}
