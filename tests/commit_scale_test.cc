// The commit protocol across daemons at the level of its parts: several daemons' real
// Catalog, ShardRegistry and CommitTracker in one process on one shared directory (as
// bench/commit_scale.cc runs them), with shards admitted and made durable by hand. Covers
// what the node markers add (issue 15): one marker per daemon and version, written once the
// daemon's shards of the version are settled; a rank that comes late; a crash between two
// markers or in the middle of a registration; a rollback; a daemon restart; and what the
// polling costs (it backs off, and stops once nothing is awaited).
#include <sys/resource.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/catalog/catalog.h"
#include "daemon/commit/commit_tracker.h"
#include "daemon/io/counting_storage.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/pipeline/shard_registry.h"
#include "format/markers.h"
#include "format/paths.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::Eventually;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;
namespace fs = std::filesystem;

namespace {

constexpr char kJob[] = "job";
constexpr auto kWait = std::chrono::seconds(20);

// One daemon's commit stage.
struct Node {
  Node(std::shared_ptr<Storage> storage, const std::string& root, const std::string& name)
      : catalog(std::move(storage), root, 0, 0, nullptr, name),
        tracker(catalog, shards,
                CommitTracker::Hooks{[this](const std::string&, std::uint64_t) { ++commits_seen; },
                                     [this](const std::shared_ptr<ShardJob>&) { ++shards_failed; },
                                     [](const std::string&) {},
                                     nullptr}) {
    tracker.Start();
  }
  // A shard admitted at snapshot time (its file is the flush engine's business, not here).
  std::shared_ptr<ShardJob> Admit(std::uint64_t version, std::uint32_t rank, std::uint32_t world,
                                  const std::string& registration) {
    ShardMeta meta{kJob, version, rank, world, registration};
    auto shard = std::make_shared<ShardJob>(ShardLayout::Unplanned(meta, {}), std::vector<ItemSource>{},
                                            catalog.VersionDir(kJob, version), false);
    (void)shards.Add(shard);  // what it lets go is freed here
    return shard;
  }
  bool Persist(const std::shared_ptr<ShardJob>& shard) { return tracker.OnPersisted(shard->meta(), shard); }

  Catalog catalog;
  ShardRegistry shards;
  CommitTracker tracker;
  std::atomic<int> commits_seen{0};
  std::atomic<int> shards_failed{0};
};

std::shared_ptr<Storage> Posix() { return std::make_shared<PosixStorage>(); }

// The node markers in the version's directory, by name.
std::vector<std::string> Markers(const std::string& root, std::uint64_t version) {
  std::vector<std::string> out;
  const std::string dir = CheckpointTree(root).VersionDir(kJob, version);
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (ParseNodeMarkerName(e.path().filename().string())) out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool Committed(const std::string& root, std::uint64_t version) {
  return fs::exists(CheckpointTree(root).CommittedMarker(kJob, version));
}

void Register(Node& n, std::uint32_t rank, const std::string& registration) {
  REQUIRE(n.catalog.WriteRankRegistration(kJob, rank, registration).ok());
}

void MakeVersionDir(const std::string& root, std::uint64_t version) {
  fs::create_directories(CheckpointTree(root).VersionDir(kJob, version));
}

}  // namespace

TEST_CASE("a daemon writes one marker for its ranks of a version, once all of them are durable",
          "[commit][scale]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  auto storage = std::make_shared<CountingStorage>(Posix());
  Node a(storage, root, "a"), b(storage, root, "b");
  for (std::uint32_t r = 0; r < 3; ++r) Register(a, r, "ra" + std::to_string(r));
  Register(b, 3, "rb3");
  MakeVersionDir(root, 1);
  std::vector<std::shared_ptr<ShardJob>> shards;
  for (std::uint32_t r = 0; r < 3; ++r) shards.push_back(a.Admit(1, r, 4, "ra" + std::to_string(r)));
  auto b3 = b.Admit(1, 3, 4, "rb3");

  const MetaOps before = storage->counts();
  REQUIRE(a.Persist(shards[2]));
  REQUIRE(a.Persist(shards[0]));
  CHECK(Markers(root, 1).empty());  // rank 1 of this daemon is still on its way
  REQUIRE(a.Persist(shards[1]));
  CHECK(Markers(root, 1) == std::vector<std::string>{NodeMarkerName(a.catalog.marker_owner(), 3)});
  CHECK_FALSE(Committed(root, 1));  // rank 3, on the other daemon, is not durable yet
  REQUIRE(b.Persist(b3));
  for (auto& s : shards) CHECK(s->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  CHECK(b3->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  CHECK(Committed(root, 1));
  auto text = ReadFile(root + "/" + kJob + "/" + VersionDirName(1) + "/" +
                       NodeMarkerName(a.catalog.marker_owner(), 3));
  CHECK(ParseNodeMarker(text) == NodeClaims{{0, "ra0"}, {1, "ra1"}, {2, "ra2"}});
  // Two markers, COMMITTED and `latest`: four files renamed into place, whatever the ranks.
  CHECK((storage->counts() - before).rename == 4);
}

TEST_CASE("a rank that comes after its daemon's marker gets a new marker holding all of them",
          "[commit][scale]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  Node a(Posix(), root, "a"), b(Posix(), root, "b");
  Register(a, 0, "r0");
  Register(a, 1, "r1");
  Register(b, 2, "r2");
  MakeVersionDir(root, 1);
  auto s0 = a.Admit(1, 0, 3, "r0");
  REQUIRE(a.Persist(s0));  // rank 1's trainer has not even snapshotted yet
  const std::string owner = a.catalog.marker_owner();
  CHECK(Markers(root, 1) == std::vector<std::string>{NodeMarkerName(owner, 1)});
  auto s2 = b.Admit(1, 2, 3, "r2");
  REQUIRE(b.Persist(s2));
  CHECK_FALSE(Committed(root, 1));
  auto s1 = a.Admit(1, 1, 3, "r1");
  REQUIRE(a.Persist(s1));
  CHECK(s1->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  CHECK(Committed(root, 1));
  // The first marker went when the second, which claims its ranks too, was in place.
  auto markers = Markers(root, 1);
  CHECK(std::count(markers.begin(), markers.end(), NodeMarkerName(owner, 1)) == 0);
  CHECK(std::count(markers.begin(), markers.end(), NodeMarkerName(owner, 2)) == 1);
  CHECK(Eventually([&] { return b.commits_seen == 1; }, kWait));
}

TEST_CASE("a marker held back for a shard that then fails is still written", "[commit][scale]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  Node a(Posix(), root, "a");
  Register(a, 0, "r0");
  Register(a, 1, "r1");
  MakeVersionDir(root, 1);
  auto s0 = a.Admit(1, 0, 2, "r0");
  auto s1 = a.Admit(1, 1, 2, "r1");
  REQUIRE(a.Persist(s0));
  CHECK(Markers(root, 1).empty());
  s1->Fail(IoError("write rank 1", EIO));  // the flush engine's doing: the tracker is not told
  CHECK(Eventually([&] { return Markers(root, 1).size() == 1; }, kWait));
  CHECK_FALSE(Committed(root, 1));
}

TEST_CASE("a crash between two markers of a daemon, or in a registration, never commits wrongly",
          "[commit][scale][crash]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  const CheckpointTree tree(root);
  Catalog a(Posix(), root, 0, 0, nullptr, "a"), b(Posix(), root, 0, 0, nullptr, "b");
  REQUIRE(a.WriteRankRegistration(kJob, 0, "r0").ok());
  REQUIRE(a.WriteRankRegistration(kJob, 1, "r1").ok());
  REQUIRE(b.WriteRankRegistration(kJob, 2, "r2").ok());
  MakeVersionDir(root, 1);
  // Daemon a wrote its marker of rank 0, then the one of ranks 0 and 1, and died before it
  // removed the first: both are there, and together they claim 3 ranks of a world of 3.
  REQUIRE(a.WriteNodeMarker(kJob, 1, {{0, "r0"}}, 0).ok());
  std::ofstream(tree.NodeMarker(kJob, 1, a.marker_owner(), 2)) << RenderNodeMarker({{0, "r0"}, {1, "r1"}});
  bool committed = true;
  std::uint64_t claimed = 0;
  REQUIRE(a.CommitIfComplete(kJob, 1, 3, &committed, &claimed).ok());
  CHECK(claimed == 3);
  CHECK_FALSE(committed);  // rank 2 is claimed by nobody: counting names is not enough
  REQUIRE(b.WriteNodeMarker(kJob, 1, {{2, "r2"}}, 0).ok());
  REQUIRE(a.CommitIfComplete(kJob, 1, 3, &committed).ok());
  CHECK(committed);

  // Rank 2 registers again, and its daemon dies after the record (generation 2) and before
  // the name: the registration failed, so rank 2 has no shard of it. Its earlier name still
  // stands (generation 1): version 2, all of the earlier run, commits.
  MakeVersionDir(root, 2);
  REQUIRE(a.WriteNodeMarker(kJob, 2, {{0, "r0"}, {1, "r1"}}, 0).ok());
  REQUIRE(b.WriteNodeMarker(kJob, 2, {{2, "r2"}}, 0).ok());
  std::ofstream(tree.RankFile(kJob, 2)) << RenderRankRecord({2, "r2-new"});
  REQUIRE(a.CommitIfComplete(kJob, 2, 3, &committed).ok());
  CHECK(committed);
  // The next registration goes above the one that failed, and only its shards count now.
  REQUIRE(b.WriteRankRegistration(kJob, 2, "r2-next").ok());
  CHECK(fs::exists(tree.RegistrationPath(kJob, {2, 3, "r2-next"})));
  // The name of generation 1 is left (the record named generation 2): it no longer counts.
  CHECK(fs::exists(tree.RegistrationPath(kJob, {2, 1, "r2"})));
  MakeVersionDir(root, 3);
  REQUIRE(a.WriteNodeMarker(kJob, 3, {{0, "r0"}, {1, "r1"}}, 0).ok());
  REQUIRE(b.WriteNodeMarker(kJob, 3, {{2, "r2"}}, 0).ok());  // a shard of the run before
  REQUIRE(a.CommitIfComplete(kJob, 3, 3, &committed).ok());
  CHECK_FALSE(committed);
  REQUIRE(b.WriteNodeMarker(kJob, 3, {{2, "r2-next"}}, 1).ok());
  REQUIRE(a.CommitIfComplete(kJob, 3, 3, &committed).ok());
  CHECK(committed);

  // Two registrations of one generation (two daemons claimed the rank at once): neither is
  // current until the rank registers again.
  std::ofstream(tree.RegistrationPath(kJob, {2, 3, "r2-twin"})) << "r2-twin";
  MakeVersionDir(root, 4);
  REQUIRE(a.WriteNodeMarker(kJob, 4, {{0, "r0"}, {1, "r1"}}, 0).ok());
  REQUIRE(b.WriteNodeMarker(kJob, 4, {{2, "r2-next"}}, 0).ok());
  REQUIRE(a.CommitIfComplete(kJob, 4, 3, &committed).ok());
  CHECK_FALSE(committed);
}

TEST_CASE("a rollback drops the markers in making, and the version numbers commit again after it",
          "[commit][scale][rollback]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  Node a(Posix(), root, "a"), b(Posix(), root, "b");
  Register(a, 0, "r0");
  Register(b, 1, "r1");
  for (std::uint64_t v : {1, 2}) MakeVersionDir(root, v);
  auto a1 = a.Admit(1, 0, 2, "r0");
  auto b1 = b.Admit(1, 1, 2, "r1");
  REQUIRE(a.Persist(a1));
  REQUIRE(b.Persist(b1));
  REQUIRE(a1->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  // Version 2: rank 0 is durable, rank 1 never will be; then rank 0 rolls back to 1.
  auto a2 = a.Admit(2, 0, 2, "r0");
  auto b2 = b.Admit(2, 1, 2, "r1");
  REQUIRE(a.Persist(a2));
  REQUIRE(a.catalog.SetAsideNewerThan(kJob, 1).ok());
  a.tracker.RolledBack(kJob, 1);
  b.tracker.RolledBack(kJob, 1);
  CHECK_FALSE(a2->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  b2->Fail(FailedPrecondition("rolled back"));
  // The restore registered both ranks again; version 2 of the new timeline commits, with
  // markers of its own (the set-aside one is not claimed again).
  Register(a, 0, "r0-b");
  Register(b, 1, "r1-b");
  MakeVersionDir(root, 2);
  auto a2b = a.Admit(2, 0, 2, "r0-b");
  auto b2b = b.Admit(2, 1, 2, "r1-b");
  REQUIRE(b.Persist(b2b));
  REQUIRE(a.Persist(a2b));
  CHECK(a2b->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  CHECK(b2b->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  auto text = ReadFile(root + "/" + kJob + "/" + VersionDirName(2) + "/" +
                       NodeMarkerName(a.catalog.marker_owner(), 1));
  CHECK(ParseNodeMarker(text) == NodeClaims{{0, "r0-b"}});
  CHECK(a.catalog.Latest(kJob) == 2);
}

TEST_CASE("a restarted deciding daemon awaits the commit of a version it had marked",
          "[commit][scale][restart]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  ShardMeta meta{kJob, 1, 0, 2, "r0"};
  MakeVersionDir(root, 1);
  {
    Node a(Posix(), root, "a");
    Register(a, 0, "r0");
    auto s0 = a.Admit(1, 0, 2, "r0");
    REQUIRE(a.Persist(s0));
  }  // the daemon of rank 0 stops; rank 1 (node b) is not durable yet
  Node b(Posix(), root, "b");
  Register(b, 1, "r1");
  Node restarted(Posix(), root, "a");
  // What the daemon does for a shard of its local tier found at start (Daemon::ResumeLocalTier).
  REQUIRE(restarted.catalog.HasDoneMarker(kJob, 1, 0, "r0"));
  restarted.tracker.Await(meta);
  auto s1 = b.Admit(1, 1, 2, "r1");
  REQUIRE(b.Persist(s1));
  CHECK(s1->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  CHECK(Eventually([&] { return restarted.commits_seen == 1; }, kWait));
  CHECK(restarted.tracker.committed_total() == 1);  // the restarted daemon decided it
}

// Before issue 15 each awaited version was polled every 20 ms for as long as it waited.
TEST_CASE("polling backs off while a version waits, and stops once nothing is awaited", "[commit][scale]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  auto storage = std::make_shared<CountingStorage>(Posix());
  Node a(storage, root, "a"), b(storage, root, "b");
  Register(a, 0, "r0");
  Register(b, 1, "r1");
  MakeVersionDir(root, 1);
  auto s0 = a.Admit(1, 0, 2, "r0");
  auto s1 = b.Admit(1, 1, 2, "r1");
  REQUIRE(a.Persist(s0));
  const MetaOps waiting = storage->counts();
  // 1.5 s of waiting: at 20 ms, 75 looks; with the backoff (10 ms doubling to 1 s) about 7.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const MetaOps waited = storage->counts() - waiting;
  INFO("readdirs " << waited.readdir);
  CHECK(waited.readdir <= 12);
  CHECK(waited.readdir >= 2);
  REQUIRE(b.Persist(s1));
  REQUIRE(s0->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
  REQUIRE(Eventually([&] { return b.commits_seen == 1; }, kWait));
  const MetaOps idle = storage->counts();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  CHECK((storage->counts() - idle).total() == 0);
}

// Found by bench/commit_scale.sh at 512 daemons: a version awaited while this daemon's
// marker of it was held back (a shard still on its way) kept the watcher waking at once,
// spinning on a core until the shard was persisted.
TEST_CASE("a marker held back for a shard on its way costs no CPU while it waits", "[commit][scale]") {
  TempDir dir("scale");
  const std::string root = dir.path();
  Node a(Posix(), root, "a");
  Register(a, 0, "r0");
  Register(a, 1, "r1");
  MakeVersionDir(root, 1);
  auto s0 = a.Admit(1, 0, 2, "r0");
  auto s1 = a.Admit(1, 1, 2, "r1");
  REQUIRE(a.Persist(s0));
  auto cpu = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  const auto before = cpu();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto used = std::chrono::duration_cast<std::chrono::milliseconds>(cpu() - before);
  INFO("CPU time while waiting: " << used.count() << " ms");
  CHECK(used < std::chrono::milliseconds(100));
  REQUIRE(a.Persist(s1));
  CHECK(s1->WaitFor(Level::kCommitted, std::chrono::steady_clock::now() + kWait).ok());
}
