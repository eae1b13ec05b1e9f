// The commit stage and the daemon's view of the checkpoint tree, on a real directory.
#include "daemon/catalog/catalog.h"

#include <sys/stat.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "daemon/io/fault_storage.h"
#include "daemon/io/storage.h"
#include "format/markers.h"
#include "format/paths.h"
#include "support/faulty_storage.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::FaultyStorage;
using ckpt::test::ListFiles;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;
namespace fs = std::filesystem;

namespace {

void Touch(const std::string& path, const std::string& content = "shard") {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  REQUIRE(out.good());
}

// What each catalog's marker of a version claims, as the commit tracker keeps it: a claim
// adds to the daemon's marker (a new marker with every rank so far replaces the old one).
std::map<std::pair<std::string, std::uint64_t>, NodeClaims>& ClaimsOf(const Catalog& catalog) {
  static std::map<std::string, std::map<std::pair<std::string, std::uint64_t>, NodeClaims>> all;
  return all[catalog.marker_owner()];
}

Status Claim(Catalog& catalog, const std::string& job, std::uint64_t version, std::uint32_t rank,
             const std::string& registration) {
  NodeClaims& claims = ClaimsOf(catalog)[{job, version}];
  NodeClaims next = claims;
  next[rank] = registration;
  Status s = catalog.WriteNodeMarker(job, version, next, claims.size());
  if (s.ok()) claims = std::move(next);
  return s;
}

// Puts the shard files of `ranks` in place with this catalog's marker claiming them, as the
// daemons publish them, each rank registered as `registration`.
void PutShards(Catalog& catalog, const std::string& job, std::uint64_t version,
               const std::vector<std::uint32_t>& ranks, const std::string& registration = "run-1") {
  for (auto r : ranks) {
    Touch(catalog.ShardPath(job, version, r), "v" + std::to_string(version));
    REQUIRE(catalog.WriteRankRegistration(job, r, registration).ok());
    REQUIRE(Claim(catalog, job, version, r, registration).ok());
  }
}

// Publishes and commits a complete version.
void Committed(Catalog& catalog, const std::string& job, std::uint64_t version, std::uint32_t world = 1) {
  std::vector<std::uint32_t> ranks;
  for (std::uint32_t r = 0; r < world; ++r) ranks.push_back(r);
  PutShards(catalog, job, version, ranks);
  bool committed = false;
  REQUIRE(catalog.CommitIfComplete(job, version, world, &committed).ok());
  REQUIRE(committed);
}

std::string LatestText(const Catalog& catalog, const std::string& job) {
  return ReadFile(catalog.JobDir(job) + "/latest");
}

bool HasMarker(const Catalog& catalog, const std::string& job, std::uint64_t version) {
  return fs::exists(catalog.VersionDir(job, version) + "/COMMITTED");
}

std::shared_ptr<Storage> Posix() { return std::make_shared<PosixStorage>(); }

// Real storage on which every rename into `latest` fails with `err` while `armed` exists.
std::shared_ptr<Storage> LatestFailsWhile(const std::string& armed, int err) {
  FaultSpec spec;
  spec.file = FaultSpec::File::kLatest;
  spec.op = FaultSpec::Op::kRename;
  spec.err = err;
  spec.while_path = armed;
  return std::make_shared<FaultStorage>(Posix(), spec);
}

}  // namespace

TEST_CASE("catalog paths follow the tree layout", "[catalog]") {
  Catalog catalog(Posix(), "/ckpt/root");
  CHECK(catalog.root() == "/ckpt/root");
  CHECK(catalog.JobDir("job-1") == "/ckpt/root/job-1");
  CHECK(catalog.VersionDir("job-1", 42) == "/ckpt/root/job-1/v0000000042");
  CHECK(catalog.ShardPath("job-1", 42, 3) == "/ckpt/root/job-1/v0000000042/rank-00003.safetensors");
}

TEST_CASE("CommitIfComplete commits only once every rank's shard is in place", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path());
  REQUIRE(catalog.Recover().ok());
  bool committed = true;

  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());  // nothing there yet
  CHECK_FALSE(committed);

  PutShards(catalog, "job", 5, {0, 1});  // the last rank is missing
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK_FALSE(committed);
  Touch(catalog.ShardPath("job", 5, 2) + ".tmp");  // still being written
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK_FALSE(committed);
  Touch(catalog.ShardPath("job", 5, 2));  // a shard without its done marker is not durable yet
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK_FALSE(committed);
  // A rank beyond the world does not count, though the names now claim 3 ranks.
  PutShards(catalog, "job", 5, {3});
  std::uint64_t claimed = 0;
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed, &claimed).ok());
  CHECK_FALSE(committed);
  CHECK(claimed == 3);
  // Rank 2, from another daemon, with an earlier registration of the rank: a leftover of
  // another run.
  Catalog node_b(Posix(), dir.path(), 0, 0, nullptr, "b");
  REQUIRE(catalog.WriteRankRegistration("job", 2, "run-1").ok());
  REQUIRE(Claim(node_b, "job", 5, 2, "run-0").ok());
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK_FALSE(committed);
  CHECK_FALSE(HasMarker(catalog, "job", 5));
  CHECK_FALSE(fs::exists(catalog.JobDir("job") + "/latest"));
  CHECK_FALSE(catalog.IsCommitted("job", 5));
  CHECK(catalog.Latest("job") == 0);

  REQUIRE(Claim(node_b, "job", 5, 2, "run-1").ok());
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK(committed);
  REQUIRE(HasMarker(catalog, "job", 5));
  CHECK(catalog.IsCommitted("job", 5));
  auto marker = nlohmann::json::parse(ReadFile(catalog.VersionDir("job", 5) + "/COMMITTED"));
  CHECK(marker["job"] == "job");
  CHECK(marker["version"] == 5);
  CHECK(marker["world_size"] == 3);
  CHECK(LatestText(catalog, "job") == "5\n");
  CHECK(catalog.Latest("job") == 5);
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 5) + "/COMMITTED.tmp"));
  CHECK_FALSE(fs::exists(catalog.JobDir("job") + "/latest.tmp"));

  // Asking again (another rank's shard turned durable) changes nothing.
  std::string before = ReadFile(catalog.VersionDir("job", 5) + "/COMMITTED");
  committed = false;
  REQUIRE(catalog.CommitIfComplete("job", 5, 3, &committed).ok());
  CHECK(committed);
  CHECK(ReadFile(catalog.VersionDir("job", 5) + "/COMMITTED") == before);
}

// Issue 12, defect 13: such a version used to be refused ("too late") and was silently lost.
TEST_CASE("a version completing after a newer one committed still commits, and latest never moves back",
          "[catalog]") {
  TempDir dir("cat");
  bool committed = false;
  {
    Catalog catalog(Posix(), dir.path());
    Committed(catalog, "job", 5);
    PutShards(catalog, "job", 3, {0});
    REQUIRE(catalog.CommitIfComplete("job", 3, 1, &committed).ok());
    CHECK(committed);
    CHECK(HasMarker(catalog, "job", 3));
    CHECK(LatestText(catalog, "job") == "5\n");
    CHECK(catalog.Latest("job") == 5);
    Committed(catalog, "job", 7);
    CHECK(LatestText(catalog, "job") == "7\n");
    CHECK(catalog.Latest("job") == 7);
  }
  // A fresh catalog (a restarted daemon) knows the newest from storage, not from memory.
  Catalog restarted(Posix(), dir.path());
  PutShards(restarted, "job", 6, {0});
  committed = false;
  REQUIRE(restarted.CommitIfComplete("job", 6, 1, &committed).ok());
  CHECK(committed);
  CHECK(LatestText(restarted, "job") == "7\n");
  CHECK(restarted.Latest("job") == 7);
}

TEST_CASE("a commit sees versions other daemons committed, and their rank registrations", "[catalog]") {
  TempDir dir("cat");
  Catalog node_a(Posix(), dir.path(), 0, 0, nullptr, "a"), node_b(Posix(), dir.path(), 0, 0, nullptr, "b");
  // Ranks 0 and 1 on two daemons; rank 0's daemon decides.
  REQUIRE(node_a.WriteRankRegistration("job", 0, "a.1").ok());
  REQUIRE(node_b.WriteRankRegistration("job", 1, "b.1").ok());
  REQUIRE(node_b.PrepareVersionDir("job", 1).ok());
  REQUIRE(Claim(node_b, "job", 1, 1, "b.1").ok());
  CHECK(node_b.HasDoneMarker("job", 1, 1, "b.1"));
  CHECK_FALSE(node_b.HasDoneMarker("job", 1, 1, "b.0"));
  CHECK_FALSE(node_a.HasDoneMarker("job", 1, 1, "b.1"));  // node b's marker, not a's
  // A restarted daemon of node b finds the marker of its earlier life.
  CHECK(Catalog(Posix(), dir.path(), 0, 0, nullptr, "b").HasDoneMarker("job", 1, 1, "b.1"));
  Touch(node_a.ShardPath("job", 1, 0));
  REQUIRE(Claim(node_a, "job", 1, 0, "a.1").ok());
  bool committed = false;
  REQUIRE(node_a.CommitIfComplete("job", 1, 2, &committed).ok());
  REQUIRE(committed);
  CHECK(node_b.RefreshLatest("job") == 1);
  // Rank 1 restarts (a new registration): its shard of version 2, written before, no
  // longer counts, and the one it writes again does.
  REQUIRE(node_b.PrepareVersionDir("job", 2).ok());
  REQUIRE(Claim(node_b, "job", 2, 1, "b.1").ok());
  REQUIRE(Claim(node_a, "job", 2, 0, "a.1").ok());
  REQUIRE(node_b.WriteRankRegistration("job", 1, "b.2").ok());
  REQUIRE(node_a.CommitIfComplete("job", 2, 2, &committed).ok());
  CHECK_FALSE(committed);
  REQUIRE(Claim(node_b, "job", 2, 1, "b.2").ok());
  REQUIRE(node_a.CommitIfComplete("job", 2, 2, &committed).ok());
  CHECK(committed);
  node_b.NoteCommitted("job", 2);
  CHECK(node_b.Latest("job") == 2);
}

TEST_CASE("retention keeps the last K committed versions and every M-th", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path(), 2, 5);
  for (std::uint64_t v = 1; v <= 20; ++v) Committed(catalog, "job", v);
  std::vector<std::uint64_t> kept;
  auto list = catalog.List("job");
  REQUIRE(list.ok());
  for (const auto& e : list.value()) kept.push_back(e.version);
  CHECK(kept == std::vector<std::uint64_t>{5, 10, 15, 19, 20});
}

TEST_CASE("jobs commit independently", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path());
  Committed(catalog, "a", 10);
  Committed(catalog, "b", 2, 2);
  CHECK(catalog.Latest("a") == 10);
  CHECK(catalog.Latest("b") == 2);
  CHECK(catalog.Latest("c") == 0);
  CHECK(LatestText(catalog, "b") == "2\n");
}

TEST_CASE("a failed commit marker leaves the version uncommitted and latest alone", "[catalog]") {
  TempDir dir("cat");
  auto storage = std::make_shared<FaultyStorage>();
  storage->fail_renames_to = "/COMMITTED";
  Catalog catalog(storage, dir.path());
  {
    Catalog healthy(Posix(), dir.path());
    Committed(healthy, "job", 1);
  }
  PutShards(catalog, "job", 2, {0});
  bool committed = true;
  Status s = catalog.CommitIfComplete("job", 2, 1, &committed);
  CHECK(s.code() == StatusCode::kIoError);
  CHECK_FALSE(committed);
  CHECK_FALSE(HasMarker(catalog, "job", 2));
  CHECK(LatestText(catalog, "job") == "1\n");
  CHECK(catalog.Latest("job") == 1);
  // No temporary marker is left behind (issue 12, defect 12: it used to stay until Recover).
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 2) + "/COMMITTED.tmp"));
  Catalog recovered(Posix(), dir.path());
  REQUIRE(recovered.Recover().ok());
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 2) + "/COMMITTED.tmp"));
  CHECK_FALSE(recovered.IsCommitted("job", 2));
  CHECK(recovered.Latest("job") == 1);
}

TEST_CASE("Recover removes temporary files and repairs latest", "[catalog]") {
  TempDir dir("cat");
  std::string root = dir.path() + "/root";
  std::string owner;
  {
    Catalog writer(Posix(), root);
    owner = writer.marker_owner();
    // job-a: v1 committed, v2 only half written, latest wrongly names v2.
    Committed(writer, "job-a", 1);
    PutShards(writer, "job-a", 2, {0});
    Touch(writer.ShardPath("job-a", 2, 1) + ".tmp");
    Touch(writer.JobDir("job-a") + "/latest", "2\n");
    Touch(writer.JobDir("job-a") + "/latest.tmp", "3\n");
    // job-b: latest names a version that was never committed, and none was.
    PutShards(writer, "job-b", 4, {0, 1});
    Touch(writer.JobDir("job-b") + "/latest", "4\n");
    // job-c: healthy; latest must be left as it is.
    Committed(writer, "job-c", 3);
    Committed(writer, "job-c", 8);
    // job-d: committed, but latest went missing.
    Committed(writer, "job-d", 6);
    fs::remove(writer.JobDir("job-d") + "/latest");
    // Not a job id: not ours to clean.
    Touch(root + "/.hidden/leftover.tmp");
  }
  Catalog catalog(Posix(), root);
  REQUIRE(catalog.Recover().ok());

  CHECK(ListFiles(catalog.JobDir("job-a")) ==
        std::vector<std::string>{
            "latest", "ranks/rank-00000", "ranks/rank-00000.2.run-1", "v0000000001/COMMITTED",
            "v0000000001/" + NodeMarkerName(owner, 1), "v0000000001/rank-00000.safetensors",
            "v0000000002/" + NodeMarkerName(owner, 1), "v0000000002/rank-00000.safetensors"});
  CHECK(LatestText(catalog, "job-a") == "1\n");
  CHECK(catalog.Latest("job-a") == 1);
  CHECK_FALSE(catalog.IsCommitted("job-a", 2));

  CHECK_FALSE(fs::exists(catalog.JobDir("job-b") + "/latest"));
  CHECK(catalog.Latest("job-b") == 0);
  CHECK(fs::exists(catalog.ShardPath("job-b", 4, 1)));  // shards stay; only their commit is missing

  CHECK(LatestText(catalog, "job-c") == "8\n");
  CHECK(catalog.Latest("job-c") == 8);

  CHECK(LatestText(catalog, "job-d") == "6\n");
  CHECK(catalog.Latest("job-d") == 6);

  CHECK(fs::exists(root + "/.hidden/leftover.tmp"));
}

TEST_CASE("Recover creates a missing root and accepts an empty one", "[catalog]") {
  TempDir dir("cat");
  std::string root = dir.path() + "/a/b/root";
  Catalog catalog(Posix(), root);
  REQUIRE(catalog.Recover().ok());
  REQUIRE(fs::is_directory(root));
  REQUIRE(catalog.Recover().ok());
  CHECK(catalog.Latest("anything") == 0);
}

TEST_CASE("PrepareVersionDir makes the version directory, private", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path() + "/root");
  REQUIRE(catalog.Recover().ok());
  REQUIRE(catalog.PrepareVersionDir("job", 9).ok());
  REQUIRE(fs::is_directory(catalog.VersionDir("job", 9)));
  struct stat st {};
  REQUIRE(::stat(catalog.VersionDir("job", 9).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(catalog.PrepareVersionDir("job", 9).ok());  // idempotent
}

TEST_CASE("List reports versions oldest first with their ranks and commit state", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path());
  CHECK(catalog.List("nope").ok());
  CHECK(catalog.List("nope")->empty());

  Committed(catalog, "job", 12, 2);
  PutShards(catalog, "job", 3, {2, 0});
  Committed(catalog, "job", 100);
  Touch(catalog.ShardPath("job", 3, 1) + ".tmp");
  fs::create_directories(catalog.JobDir("job") + "/vjunk");
  // Only the canonical spelling is a version: "v7" is not v0000000007 (issue 12, defect 11).
  fs::create_directories(catalog.JobDir("job") + "/v7");
  fs::create_directories(catalog.JobDir("job") + "/v0000000007");
  fs::create_directories(catalog.JobDir("job") + "/set-aside/v0000000200");

  auto list = catalog.List("job");
  REQUIRE(list.ok());
  REQUIRE(list->size() == 4);
  const auto& v = list.value();
  CHECK(v[0].version == 3);
  CHECK_FALSE(v[0].committed);
  CHECK(v[0].ranks == std::vector<std::uint32_t>{0, 2});
  CHECK(v[1].version == 7);
  CHECK(v[1].ranks.empty());
  CHECK(v[2].version == 12);
  CHECK(v[2].committed);
  CHECK(v[2].ranks == std::vector<std::uint32_t>{0, 1});
  CHECK(v[3].version == 100);
  CHECK(v[3].committed);
}

TEST_CASE("SetAsideNewerThan moves newer versions away and points latest back", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path());
  Committed(catalog, "job", 1);
  Committed(catalog, "job", 2);
  Committed(catalog, "job", 3);
  PutShards(catalog, "job", 4, {0});  // in flight when the rollback came
  REQUIRE(catalog.Latest("job") == 3);

  auto moved = catalog.SetAsideNewerThan("job", 2);
  REQUIRE(moved.ok());
  CHECK(moved.value() == 2);
  std::string aside = catalog.JobDir("job") + "/set-aside";
  CHECK(fs::exists(aside + "/v0000000003/COMMITTED"));
  CHECK(fs::exists(aside + "/v0000000003/rank-00000.safetensors"));
  CHECK(fs::exists(aside + "/v0000000004/rank-00000.safetensors"));
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 3)));
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 4)));
  CHECK(LatestText(catalog, "job") == "2\n");
  CHECK(catalog.Latest("job") == 2);
  auto list = catalog.List("job");
  REQUIRE(list.ok());
  REQUIRE(list->size() == 2);
  CHECK(list.value()[1].version == 2);

  // Nothing newer: nothing moves and latest stays.
  auto none = catalog.SetAsideNewerThan("job", 2);
  REQUIRE(none.ok());
  CHECK(none.value() == 0);
  CHECK(LatestText(catalog, "job") == "2\n");

  // Numbering continues from the rollback point; a second rollback keeps both copies of v3.
  Committed(catalog, "job", 3);
  CHECK(LatestText(catalog, "job") == "3\n");
  moved = catalog.SetAsideNewerThan("job", 2);
  REQUIRE(moved.ok());
  CHECK(moved.value() == 1);
  CHECK(fs::exists(aside + "/v0000000003/COMMITTED"));
  CHECK(fs::exists(aside + "/v0000000003.1/COMMITTED"));
  CHECK(catalog.Latest("job") == 2);

  // A restarted daemon agrees: set-aside versions do not count as committed.
  Catalog restarted(Posix(), dir.path());
  REQUIRE(restarted.Recover().ok());
  CHECK(restarted.Latest("job") == 2);
  CHECK(LatestText(restarted, "job") == "2\n");
}

// Issue 12, defect 10: List and Prefetch take any job id; each used to leave an entry.
TEST_CASE("job ids nobody created are not cached, however many are asked for", "[catalog]") {
  TempDir dir("cat");
  Catalog catalog(Posix(), dir.path());
  for (int i = 0; i < 1000; ++i) {
    CHECK(catalog.Latest("nope-" + std::to_string(i)) == 0);
    CHECK(catalog.RefreshLatest("gone-" + std::to_string(i)) == 0);
  }
  CHECK(catalog.cached_jobs() == 0);
  Committed(catalog, "job", 3);
  CHECK(catalog.Latest("job") == 3);
  CHECK(catalog.cached_jobs() == 1);
}

// Issue 12, defect 12: a failed atomic write used to leave its .tmp until the next restart.
TEST_CASE("a failed atomic write leaves no temporary file", "[catalog][faults]") {
  TempDir dir("cat");
  for (int step = 0; step < 3; ++step) {
    auto storage = std::make_shared<FaultyStorage>();
    if (step == 0) storage->fail_write_on = 1;
    if (step == 1) storage->datasync_errno = EIO;
    if (step == 2) storage->fail_renames_to = "/latest";
    INFO("step " << step);
    CHECK_FALSE(storage->WriteFileAtomic(dir.path() + "/latest", "7\n").ok());
    for (const auto& e : fs::directory_iterator(dir.path())) {
      CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
    }
    CHECK_FALSE(fs::exists(dir.path() + "/latest"));
  }
}

// Issue 12, defect 6: a failed write of `latest` after COMMITTED was silent, left the
// daemon's newest version stale, and was never retried.
TEST_CASE("a failed write of latest after COMMITTED: committed, reported, cached right, repaired",
          "[catalog][faults]") {
  TempDir dir("cat");
  const std::string armed = dir.path() + "/armed";
  std::vector<std::string> reported;
  Catalog catalog(LatestFailsWhile(armed, EIO), dir.path() + "/root", 0, 0,
                  [&](const std::string& m) { reported.push_back(m); });
  REQUIRE(catalog.Recover().ok());
  Committed(catalog, "job", 1);
  Touch(armed);

  PutShards(catalog, "job", 2, {0});
  bool committed = false;
  REQUIRE(catalog.CommitIfComplete("job", 2, 1, &committed).ok());
  CHECK(committed);
  CHECK(HasMarker(catalog, "job", 2));
  CHECK(catalog.Latest("job") == 2);  // the truth, not the stale file
  CHECK(LatestText(catalog, "job") == "1\n");
  CHECK(catalog.stale_latest() == 1);
  REQUIRE(reported.size() == 1);
  CHECK(reported[0].find(catalog.JobDir("job") + "/latest could not be updated to 2") != std::string::npos);
  for (const auto& f : ListFiles(catalog.JobDir("job"))) CHECK(f.find(".tmp") == std::string::npos);

  catalog.RepairLatest();  // still failing: not reported again
  CHECK(catalog.stale_latest() == 1);
  CHECK(reported.size() == 1);
  fs::remove(armed);
  catalog.RepairLatest();
  CHECK(LatestText(catalog, "job") == "2\n");
  CHECK(catalog.stale_latest() == 0);

  // A rollback whose `latest` cannot be written: the versions are set aside all the same,
  // and the daemon's newest version follows them.
  Committed(catalog, "job", 3);
  Touch(armed);
  auto moved = catalog.SetAsideNewerThan("job", 1);
  REQUIRE(moved.ok());
  CHECK(moved.value() == 2);
  CHECK(catalog.Latest("job") == 1);
  CHECK(LatestText(catalog, "job") == "3\n");
  fs::remove(armed);
  catalog.RepairLatest();
  CHECK(LatestText(catalog, "job") == "1\n");
}

TEST_CASE("a marker whose directory fsync failed is taken back: no commit counts it", "[catalog][faults]") {
  TempDir dir("cat");
  auto storage = std::make_shared<FaultyStorage>();
  Catalog catalog(storage, dir.path());
  Committed(catalog, "job", 1);
  PutShards(catalog, "job", 2, {0});
  // Single-threaded here, so the fault can be switched between calls.
  storage->syncdir_errno = EIO;
  bool committed = true;
  CHECK_FALSE(catalog.CommitIfComplete("job", 2, 1, &committed).ok());
  CHECK_FALSE(committed);
  CHECK_FALSE(HasMarker(catalog, "job", 2));  // it had its name, not known durable
  CHECK(catalog.Latest("job") == 1);

  Touch(catalog.ShardPath("job", 3, 0), "v3");
  CHECK_FALSE(Claim(catalog, "job", 3, 0, "run-1").ok());
  CHECK_FALSE(fs::exists(catalog.VersionDir("job", 3) + "/" + NodeMarkerName(catalog.marker_owner(), 1)));
  storage->syncdir_errno = 0;
  REQUIRE(catalog.CommitIfComplete("job", 3, 1, &committed).ok());
  CHECK_FALSE(committed);  // rank 0's marker was not written
}

namespace {

// Real storage whose List fails (EMFILE, as when the daemon runs out of descriptors) while
// `fail_list` is set.
class ListFailingStorage : public StorageWrapper {
 public:
  explicit ListFailingStorage(std::shared_ptr<Storage> target) : StorageWrapper(std::move(target)) {}
  Result<std::vector<std::string>> List(const std::string& dir) override {
    if (fail_list) return IoError("list " + dir, EMFILE);
    return StorageWrapper::List(dir);
  }
  std::atomic<bool> fail_list{false};
};

}  // namespace

// A scan of the job directory that fails is not "nothing committed": the repair of a stale
// `latest` used to publish the failed scan's 0, which removed `latest` and told new
// registrations that nothing was committed (found by review of issue 12's change).
TEST_CASE("a repair of latest during a failed listing moves nothing backwards", "[catalog][faults]") {
  TempDir dir("cat");
  const std::string armed = dir.path() + "/armed";
  auto storage = std::make_shared<ListFailingStorage>(LatestFailsWhile(armed, EIO));
  Catalog catalog(storage, dir.path() + "/root", 0, 0, [](const std::string&) {});
  REQUIRE(catalog.Recover().ok());
  Committed(catalog, "job", 1);
  Touch(armed);
  Committed(catalog, "job", 2);  // `latest` stays "1": stale
  REQUIRE(catalog.stale_latest() == 1);
  fs::remove(armed);

  storage->fail_list = true;
  catalog.RepairLatest();
  CHECK(catalog.stale_latest() == 1);  // nothing repaired, nothing lost
  CHECK(LatestText(catalog, "job") == "1\n");
  CHECK(catalog.Latest("job") == 2);
  CHECK(catalog.RefreshLatest("job") == 2);

  storage->fail_list = false;
  catalog.RepairLatest();
  CHECK(catalog.stale_latest() == 0);
  CHECK(LatestText(catalog, "job") == "2\n");
}

// A `latest` that recovery cannot rewrite because the tier is full or read-only no longer
// stops the daemon's start (every trainer of the node would fail to reconnect): it is
// reported and repaired later, like a commit's. A directory in its place still stops it.
TEST_CASE("Recover reports a latest it cannot rewrite and goes on", "[catalog][faults]") {
  TempDir dir("cat");
  const std::string root = dir.path() + "/root";
  {
    Catalog first(Posix(), root, 0, 0);
    REQUIRE(first.Recover().ok());
    Committed(first, "job", 1);
    Committed(first, "job", 2);
  }
  Touch(root + "/job/latest", "1\n");  // a crash between COMMITTED and latest
  const std::string armed = dir.path() + "/armed";
  Touch(armed);
  std::vector<std::string> reported;
  Catalog catalog(LatestFailsWhile(armed, EROFS), root, 0, 0,
                  [&](const std::string& m) { reported.push_back(m); });
  REQUIRE(catalog.Recover().ok());
  CHECK(catalog.Latest("job") == 2);
  CHECK(catalog.stale_latest() == 1);
  REQUIRE(reported.size() == 1);
  CHECK(reported[0].find("could not be updated to 2") != std::string::npos);
  fs::remove(armed);
  catalog.RepairLatest();
  CHECK(LatestText(catalog, "job") == "2\n");
}

// Issue 17: a version not committed yet whose every rank's shard is replicated.
TEST_CASE("RESTORABLE is written once the .repl markers claim every rank with its current registration",
          "[catalog][replication]") {
  TempDir dir("catrepl");
  Catalog a(Posix(), dir.path(), 0, 0, nullptr, "a");
  Catalog b(Posix(), dir.path(), 0, 0, nullptr, "b");
  REQUIRE(a.Recover().ok());
  for (std::uint32_t r = 0; r < 3; ++r) REQUIRE(a.WriteRankRegistration("job", r, "run-1").ok());
  REQUIRE(a.PrepareVersionDir("job", 7).ok());
  auto replicated = [](Catalog& c, std::uint64_t v, const NodeClaims& claims, std::uint64_t replaces) {
    return c.WriteNodeMarker("job", v, claims, replaces, NodeMarkerKind::kReplicated);
  };
  bool restorable = true;
  REQUIRE(a.DecideRestorable("job", 7, 3, &restorable).ok());
  CHECK_FALSE(restorable);
  REQUIRE(replicated(a, 7, {{0, "run-1"}, {1, "run-1"}}, 0).ok());
  REQUIRE(a.DecideRestorable("job", 7, 3, &restorable).ok());
  CHECK_FALSE(restorable);  // rank 2 is missing
  // Done markers are not replica claims, and an earlier run's claim of rank 2 does not count.
  REQUIRE(b.WriteNodeMarker("job", 7, {{2, "run-1"}}, 0).ok());
  REQUIRE(replicated(b, 7, {{2, "run-0"}}, 0).ok());
  REQUIRE(b.DecideRestorable("job", 7, 3, &restorable).ok());
  CHECK_FALSE(restorable);
  CHECK_FALSE(fs::exists(a.VersionDir("job", 7) + "/RESTORABLE"));
  CHECK(a.RestorableNewerThan("job", 0).empty());

  REQUIRE(replicated(b, 7, {{2, "run-1"}}, 1).ok());  // the same count: rewritten in place
  REQUIRE(b.DecideRestorable("job", 7, 3, &restorable).ok());
  CHECK(restorable);
  CHECK(ReadFile(a.VersionDir("job", 7) + "/RESTORABLE") == "world_size 3\n0 run-1\n1 run-1\n2 run-1\n");
  auto marker = a.ReadRestorable("job", 7);
  REQUIRE(marker.ok());
  CHECK(marker->world_size == 3);
  CHECK(marker->registrations == NodeClaims{{0, "run-1"}, {1, "run-1"}, {2, "run-1"}});
  CHECK(a.RestorableNewerThan("job", 0) == std::vector<std::uint64_t>{7});
  CHECK(a.RestorableNewerThan("job", 7).empty());
  // Which of a RESTORABLE's shards are durable: those the done markers claim.
  CHECK(a.DurableClaims("job", 7, marker->registrations) == NodeClaims{{2, "run-1"}});
  CHECK_FALSE(a.IsCommitted("job", 7));
  CHECK(a.Latest("job") == 0);  // a RESTORABLE is no commit

  // A restore of an older version leaves the timeline above it.
  a.DropRestorableNewerThan("job", 6);
  CHECK_FALSE(fs::exists(a.VersionDir("job", 7) + "/RESTORABLE"));
  CHECK(a.RestorableNewerThan("job", 0).empty());

  // A stray or torn RESTORABLE is not taken.
  Touch(a.VersionDir("job", 7) + "/RESTORABLE", "world_size 3\n0 run-1\n");
  CHECK(a.ReadRestorable("job", 7).status().code() == StatusCode::kDataLoss);
  // A committed version is never decided restorable.
  Committed(a, "job", 8);
  REQUIRE(replicated(a, 8, {{0, "run-1"}}, 0).ok());
  REQUIRE(a.DecideRestorable("job", 8, 1, &restorable).ok());
  CHECK_FALSE(restorable);
  CHECK_FALSE(fs::exists(a.VersionDir("job", 8) + "/RESTORABLE"));
}
