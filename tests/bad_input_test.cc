// Bad input: each gets a gRPC error naming the problem, the daemon keeps serving others,
// and nothing committed is touched.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "format/paths.h"
#include "format/shard_format.h"
#include "shm/descriptor_table.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

// A daemon with one healthy job ("canary") that has a committed version, so each bad call
// can be followed by proof that others are still served and committed data is intact.
struct Fixture {
  explicit Fixture(std::vector<std::string> extra_args = {})
      : daemon(MakeOptions(dir, std::move(extra_args))) {
    canary.register_items("canary", 0, 1, canary_state.Items());
    canary_state.Fill(1);
    canary.snapshot(1);
    canary.wait_durable(1);
  }

  TempDir dir{"bad"};
  DaemonProcess daemon;
  TrainerState canary_state{2, 1 << 20, 99};
  Client canary = Client::connect(daemon.socket());
  std::uint64_t canary_version = 1;

  static DaemonOptions MakeOptions(const TempDir& d, std::vector<std::string> extra_args) {
    DaemonOptions o;
    o.root = d.path() + "/root";
    o.socket = d.path() + "/sock/ckptd.sock";
    o.extra_args = std::move(extra_args);
    return o;
  }

  std::string CanaryShard(std::uint64_t v) const {
    return daemon.root() + "/canary/" + VersionDirName(v) + "/" + ShardFileName(0);
  }

  // The daemon still serves the canary, and its first committed version is untouched.
  void CheckStillServing() {
    REQUIRE(daemon.running());
    ++canary_version;
    canary_state.Fill(canary_version);
    canary.snapshot(canary_version);
    canary.wait_durable(canary_version);
    REQUIRE(VerifyShard(CanaryShard(1)).ok());
    REQUIRE(ReadShardItem(CanaryShard(1), "t0") == canary_state.Expected(0, 1));
    REQUIRE(ReadShardItem(CanaryShard(canary_version), "t1") == canary_state.Expected(1, canary_version));
  }
};

// Runs `fn`, which must throw ckpt::Error with `code` and a message containing `text`.
template <typename Fn>
void ExpectError(Fn&& fn, grpc::StatusCode code, const std::string& text) {
  try {
    fn();
    FAIL("expected an error containing '" << text << "'");
  } catch (const Error& e) {
    INFO("message: " << e.what());
    CHECK(e.code() == static_cast<int>(code));
    CHECK(std::string(e.what()).find(text) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("unknown or closed session", "[bad-input]") {
  Fixture f;
  auto stub = f.daemon.Stub();
  {
    grpc::ClientContext ctx;
    v1::SnapshotRequest req;
    req.set_session("0123456789abcdef0123456789abcdef");
    req.set_version(1);
    v1::SnapshotReply rep;
    grpc::Status s = stub->Snapshot(&ctx, req, &rep);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(s.error_message().find("unknown or closed session") != std::string::npos);
  }
  // Register by hand to learn the session id, close it, then use it.
  TrainerState state(1, 4096);
  auto table = DescriptorTable::Create("", 4);
  REQUIRE(table.ok());
  REQUIRE(table->Write({TableItem{"w", DType::kF32, {1024}, state.region()->name(), 0, 4096, 0}}).ok());
  std::string session;
  {
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_job("closed");
    req.set_rank(0);
    req.set_world_size(1);
    req.set_descriptor_table(table->name());
    v1::RegisterReply rep;
    REQUIRE(stub->Register(&ctx, req, &rep).ok());
    session = rep.session();
  }
  {
    grpc::ClientContext ctx;
    v1::UnregisterRequest req;
    req.set_session(session);
    v1::UnregisterReply rep;
    REQUIRE(stub->Unregister(&ctx, req, &rep).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    req.set_session(session);
    req.set_version(1);
    req.set_level(v1::LEVEL_CAPTURED);
    v1::WaitReply rep;
    grpc::Status s = stub->Wait(&ctx, req, &rep);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(s.error_message().find("unknown or closed session") != std::string::npos);
  }
  f.CheckStillServing();
}

TEST_CASE("a version not higher than the last one", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  Client c = Client::connect(f.daemon.socket());
  c.register_items("versions", 0, 1, state.Items());
  c.snapshot(5);
  ExpectError([&] { c.snapshot(5); }, grpc::StatusCode::FAILED_PRECONDITION,
              "version 5 is not higher than 5");
  ExpectError([&] { c.snapshot(3); }, grpc::StatusCode::FAILED_PRECONDITION,
              "version 3 is not higher than 5");
  ExpectError([&] { c.snapshot(0); }, grpc::StatusCode::INVALID_ARGUMENT, "version 0 is not in [1, ");
  ExpectError([&] { c.snapshot(std::uint64_t{1} << 62); }, grpc::StatusCode::INVALID_ARGUMENT,
              "is not in [1, ");
  c.wait_durable(5);
  // A version at or below the newest committed one, from a new registration, is refused too.
  c.unregister();
  Client again = Client::connect(f.daemon.socket());
  again.register_items("versions", 0, 1, state.Items());
  ExpectError([&] { again.snapshot(4); }, grpc::StatusCode::FAILED_PRECONDITION, "newest committed version");
  ExpectError([&] { again.wait_snapshot(4); }, grpc::StatusCode::NOT_FOUND,
              "version 4 was not snapshotted by this registration of job 'versions' (rank 0); `ckptctl ls "
              "--job versions` shows which versions are committed");
  ExpectError([&] { again.snapshot(5); }, grpc::StatusCode::FAILED_PRECONDITION,
              "to resume it, restore first");
  f.CheckStillServing();
}

TEST_CASE("a wait on a version this registration no longer tracks says what to do instead", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  Client c = Client::connect(f.daemon.socket());
  c.register_items("untracked", 0, 1, state.Items());
  // A registration keeps its newest 16 snapshots once older ones are persisted.
  for (std::uint64_t v = 1; v <= 20; ++v) {
    c.snapshot(v);
    c.wait_durable(v);
  }
  ExpectError([&] { c.wait_durable(2); }, grpc::StatusCode::NOT_FOUND,
              "version 2 is older than the versions this registration still tracks (from ");
  ExpectError([&] { c.wait_durable(2); }, grpc::StatusCode::NOT_FOUND,
              "`ckptctl ls --job untracked` shows whether it is committed");
  ExpectError([&] { c.wait_snapshot(21); }, grpc::StatusCode::NOT_FOUND,
              "version 21 was not snapshotted by this registration of job 'untracked' (rank 0), whose newest "
              "snapshot is version 20");
  f.CheckStillServing();
}

TEST_CASE("an item beyond its region, a missing region, a region smaller than declared", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  Client c = Client::connect(f.daemon.socket());
  std::vector<TensorItem> items = {{"w", DType::kF32, {1024}, state.region(), 8}};  // 8 bytes past the end
  ExpectError([&] { c.register_items("bounds", 0, 1, items); }, grpc::StatusCode::INVALID_ARGUMENT,
              "needs bytes [8, 4104) of region");

  auto stub = f.daemon.Stub();
  auto table = DescriptorTable::Create("", 4);
  REQUIRE(table.ok());
  REQUIRE(table->Write({TableItem{"w", DType::kF32, {1024}, "/ckpt-test-no-such-region", 0, 4096, 0}}).ok());
  grpc::ClientContext ctx;
  v1::RegisterRequest req;
  req.set_job("missing");
  req.set_rank(0);
  req.set_world_size(1);
  req.set_descriptor_table(table->name());
  v1::RegisterReply rep;
  grpc::Status s = stub->Register(&ctx, req, &rep);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(s.error_message().find("/ckpt-test-no-such-region does not exist") != std::string::npos);

  grpc::ClientContext ctx2;
  req.set_descriptor_table("/ckpt-test-no-such-table");
  s = stub->Register(&ctx2, req, &rep);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(s.error_message().find("descriptor table") != std::string::npos);

  // A region that shrinks after registration: the client notices before the snapshot.
  Client shrink = Client::connect(f.daemon.socket());
  TrainerState small(1, 8192);
  shrink.register_items("shrink", 0, 1, small.Items());
  small.region()->resize(4096);
  ExpectError([&] { shrink.snapshot(1); }, grpc::StatusCode::FAILED_PRECONDITION,
              "changed since registration");
  f.CheckStillServing();
}

// Issue 12, defect 12: these used to return UNKNOWN ("Too many levels of symbolic links").
TEST_CASE("a symlink or a directory where a region should be is refused as invalid", "[bad-input]") {
  Fixture f;
  auto stub = f.daemon.Stub();
  const std::string base = "/ckpt-test-odd-" + std::to_string(::getpid());
  const std::string link = base + "-link", dir = base + "-dir";
  TrainerState target(1, 4096);
  ::unlink(("/dev/shm" + link).c_str());
  ::rmdir(("/dev/shm" + dir).c_str());
  REQUIRE(::symlink(("/dev/shm/" + target.region()->name().substr(1)).c_str(), ("/dev/shm" + link).c_str()) == 0);
  REQUIRE(::mkdir(("/dev/shm" + dir).c_str(), 0700) == 0);
  for (const std::string& region : {link, dir}) {
    auto table = DescriptorTable::Create("", 4);
    REQUIRE(table.ok());
    REQUIRE(table->Write({TableItem{"w", DType::kF32, {1024}, region, 0, 4096, 0}}).ok());
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_job("odd");
    req.set_rank(0);
    req.set_world_size(1);
    req.set_descriptor_table(table->name());
    v1::RegisterReply rep;
    grpc::Status s = stub->Register(&ctx, req, &rep);
    INFO(region << ": " << s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find("is not a shared-memory object") != std::string::npos);
  }
  ::unlink(("/dev/shm" + link).c_str());
  ::rmdir(("/dev/shm" + dir).c_str());
  f.CheckStillServing();
}

TEST_CASE("bad item and blob names", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  struct Case {
    std::string name;
    std::string why;
  };
  std::vector<Case> cases = {
      {"", "is empty"},
      {std::string(256, 'x'), "longer than 255"},
      {"a/b", "contains '/'"},
      {"..", "contains '..'"},
      {"up..dir", "contains '..'"},
      {std::string("nul\0byte", 8), "NUL"},
      {"tab\there", "control character"},
      {"bell\x07", "control character"},
  };
  for (const auto& bad : cases) {
    INFO("name " << bad.why);
    Client c = Client::connect(f.daemon.socket());
    std::vector<TensorItem> items = {{bad.name, DType::kF32, {1024}, state.region(), 0}};
    ExpectError([&] { c.register_items("names", 0, 1, items); }, grpc::StatusCode::INVALID_ARGUMENT, bad.why);
  }
  Client c = Client::connect(f.daemon.socket());
  c.register_items("names", 0, 1, state.Items());
  ExpectError([&] { c.snapshot(1, {{"a/b", "x"}}); }, grpc::StatusCode::INVALID_ARGUMENT, "contains '/'");
  ExpectError([&] { c.snapshot(1, {{"t0", "x"}}); }, grpc::StatusCode::ALREADY_EXISTS, "already used");
  ExpectError(
      [&] {
        c.snapshot(1, {{"b", "x"}, {"b", "y"}});
      },
      grpc::StatusCode::ALREADY_EXISTS, "already used");
  f.CheckStillServing();
}

TEST_CASE("duplicate item names", "[bad-input]") {
  Fixture f;
  TrainerState state(2, 4096);
  Client c = Client::connect(f.daemon.socket());
  std::vector<TensorItem> items = {{"w", DType::kF32, {1024}, state.region(), 0},
                                   {"w", DType::kF32, {1024}, state.region(), 4096}};
  ExpectError([&] { c.register_items("dups", 0, 1, items); }, grpc::StatusCode::ALREADY_EXISTS,
              "duplicate item name 'w'");
  f.CheckStillServing();
}

TEST_CASE("rank outside the world size, and a rank registered twice", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  Client c = Client::connect(f.daemon.socket());
  ExpectError([&] { c.register_items("ranks", 2, 2, state.Items()); }, grpc::StatusCode::INVALID_ARGUMENT,
              "rank 2 is outside world size 2");
  ExpectError([&] { c.register_items("ranks", 0, 0, state.Items()); }, grpc::StatusCode::INVALID_ARGUMENT,
              "world size 0");
  c.register_items("ranks", 1, 2, state.Items());
  Client twin = Client::connect(f.daemon.socket());
  ExpectError([&] { twin.register_items("ranks", 1, 2, state.Items()); }, grpc::StatusCode::ALREADY_EXISTS,
              "rank 1 of job 'ranks' is already registered by pid " + std::to_string(::getpid()));
  f.CheckStillServing();
}

TEST_CASE("job ids that would escape the root", "[bad-input]") {
  Fixture f;
  TrainerState state(1, 4096);
  for (const std::string& job :
       std::vector<std::string>{"../escape", "a/b", ".hidden", "..", "", "sp ace", std::string(129, 'j')}) {
    INFO("job " << job);
    Client c = Client::connect(f.daemon.socket());
    ExpectError([&] { c.register_items(job, 0, 1, state.Items()); }, grpc::StatusCode::INVALID_ARGUMENT,
                "job id");
  }
  CHECK_FALSE(fs::exists(f.dir.path() + "/escape"));
  f.CheckStillServing();
}

TEST_CASE("a peer with another uid is refused", "[bad-input][root]") {
  if (::geteuid() != 0) {
    WARN("needs root to act as another uid; skipped");
    return;
  }
  TempDir dir("uid");
  fs::create_directories(dir.path() + "/sock");
  ::chmod(dir.path().c_str(), 0755);
  ::chmod((dir.path() + "/sock").c_str(), 0755);
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  // The socket is open to everyone, so only the daemon's own check can refuse the other uid.
  o.extra_args = {"--socket-mode", "0666"};
  DaemonProcess daemon(o);
  pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    auto stub =
        v1::Checkpoint::NewStub(grpc::CreateChannel("unix:" + o.socket, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::StatusReply rep;
    grpc::Status s = stub->Status(&ctx, v1::StatusRequest(), &rep);
    bool refused = s.error_code() == grpc::StatusCode::PERMISSION_DENIED &&
                   s.error_message().find("peer uid 65534") != std::string::npos;
    ::_exit(refused ? 0 : 11);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // The daemon's own uid is still served.
  REQUIRE(daemon.Status().pid() == daemon.pid());
}

TEST_CASE("the disk filling up during a flush fails that version only", "[bad-input][root]") {
  if (::geteuid() != 0) {
    WARN("needs root to mount a small tmpfs; skipped");
    return;
  }
  TempDir dir("enospc");
  std::string mnt = dir.path() + "/small";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=40m") != 0) {
    WARN("cannot mount tmpfs here; skipped");
    return;
  }
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mnt};
  {
    DaemonOptions o;
    o.root = mnt + "/root";
    o.socket = dir.path() + "/sock/ckptd.sock";
    o.pool_mib = 32;
    o.chunk_mib = 1;
    DaemonProcess daemon(o);
    TrainerState state(4, 4 << 20);  // 16 MiB a version: two fit in 40 MiB, the third does not
    Client c = Client::connect(daemon.socket());
    c.register_items("full", 0, 1, state.Items());
    for (std::uint64_t v = 1; v <= 2; ++v) {
      state.Fill(v);
      c.snapshot(v);
      c.wait_durable(v);
    }
    state.Fill(3);
    c.snapshot(3);
    ExpectError([&] { c.wait_durable(3); }, grpc::StatusCode::RESOURCE_EXHAUSTED, "No space left on device");
    // Older versions are intact, latest still names 2, no partial file is left.
    for (std::uint64_t v = 1; v <= 2; ++v) {
      std::string shard = o.root + "/full/" + VersionDirName(v) + "/" + ShardFileName(0);
      REQUIRE(VerifyShard(shard).ok());
      REQUIRE(ReadShardItem(shard, "t3") == state.Expected(3, v));
    }
    CHECK(ReadFile(o.root + "/full/latest") == "2\n");
    CHECK_FALSE(fs::exists(o.root + "/full/" + VersionDirName(3) + "/" + ShardFileName(0) + ".tmp"));
    v1::StatusReply st = daemon.Status();
    REQUIRE(st.errors_size() >= 1);
    CHECK(st.errors(st.errors_size() - 1).find("No space left on device") != std::string::npos);
    // The daemon keeps serving: after space is freed, the next version commits.
    fs::remove_all(o.root + "/full/" + VersionDirName(1));
    state.Fill(4);
    c.snapshot(4);
    c.wait_durable(4);
    REQUIRE(VerifyShard(o.root + "/full/" + VersionDirName(4) + "/" + ShardFileName(0)).ok());
  }
}

TEST_CASE("restore into a registration that does not match the checkpoint", "[bad-input]") {
  Fixture f;
  TrainerState state(2, 4096);
  {
    Client writer = Client::connect(f.daemon.socket());
    writer.register_items("shape", 0, 1, state.Items());
    state.Fill(1);
    writer.snapshot(1);
    writer.wait_durable(1);
  }
  struct Case {
    std::vector<TensorItem> items;
    std::string why;
  };
  auto region = state.region();
  std::vector<Case> cases = {
      {{{"t0", DType::kF32, {1024}, region, 0}, {"t1", DType::kF16, {2048}, region, 4096}},
       "item 't1' is F32 in the checkpoint but registered as F16"},
      {{{"t0", DType::kF32, {1024}, region, 0}, {"t1", DType::kF32, {32, 32}, region, 4096}},
       "item 't1' has shape [1024] in the checkpoint but is registered with shape [32, 32]"},
      {{{"t0", DType::kF32, {1024}, region, 0}, {"t1", DType::kF32, {512}, region, 4096}},
       "item 't1' has shape [1024] in the checkpoint but is registered with shape [512]"},
      {{{"t0", DType::kF32, {1024}, region, 0}, {"other", DType::kF32, {1024}, region, 4096}},
       "the checkpoint has no tensor item 'other'"},
      {{{"t0", DType::kF32, {1024}, region, 0}}, "the checkpoint has tensor item 't1'"},
  };
  for (const auto& c : cases) {
    INFO(c.why);
    Client reader = Client::connect(f.daemon.socket());
    reader.register_items("shape", 0, 1, c.items);
    std::memset(region->data(), 0x5A, state.total_bytes());
    ExpectError([&] { reader.restore(); }, grpc::StatusCode::FAILED_PRECONDITION, c.why);
    // The layout is checked before any byte is written.
    CHECK(static_cast<unsigned char*>(region->data())[0] == 0x5A);
  }
  Client missing = Client::connect(f.daemon.socket());
  missing.register_items("shape", 0, 1, state.Items());
  ExpectError([&] { missing.restore(7); }, grpc::StatusCode::NOT_FOUND,
              "version 7 of job 'shape' is not committed");
  Client fresh = Client::connect(f.daemon.socket());
  fresh.register_items("nothing-yet", 0, 1, state.Items());
  ExpectError([&] { fresh.restore(); }, grpc::StatusCode::NOT_FOUND, "has no committed version");
  f.CheckStillServing();
}

TEST_CASE("a corrupted shard is refused on restore with the item named", "[bad-input]") {
  // No memory tier: the restore reads the file (an intact copy in memory would be used).
  Fixture f({"--memory-mib", "0"});
  TrainerState state(2, 8192);
  Client c = Client::connect(f.daemon.socket());
  c.register_items("corrupt", 0, 1, state.Items());
  state.Fill(1);
  c.snapshot(1);
  c.wait_durable(1);
  std::string shard = f.daemon.root() + "/corrupt/" + VersionDirName(1) + "/" + ShardFileName(0);
  {
    auto info = ReadShardHeader(shard);
    REQUIRE(info.ok());
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(info->data_start + 8192 + 100);  // inside t1
    file.seekg(at);
    char byte = 0;
    file.get(byte);
    file.seekp(at);
    file.put(static_cast<char>(byte ^ 0xff));
  }
  ExpectError([&] { c.restore(); }, grpc::StatusCode::DATA_LOSS, "checksum mismatch in item 't1'");
  f.CheckStillServing();
}

TEST_CASE("a re-registration is validated at once and a good one takes effect", "[bad-input]") {
  Fixture f;
  TrainerState state(2, 4096);
  Client c = Client::connect(f.daemon.socket());
  c.register_items("rereg", 0, 1, state.Items());
  std::vector<TensorItem> bad = {{"t0", DType::kF32, {2048}, state.region(), 4096}};  // past the end
  ExpectError([&] { c.register_items("rereg", 0, 1, bad); }, grpc::StatusCode::INVALID_ARGUMENT,
              "needs bytes [4096, 12288) of region");
  // A good re-registration (one tensor instead of two) is what the next snapshot stores.
  std::vector<TensorItem> one = {{"only", DType::kF32, {2048}, state.region(), 0}};
  REQUIRE(c.register_items("rereg", 0, 1, one).item_count == 1);
  c.snapshot(1);
  c.wait_durable(1);
  auto info = ReadShardHeader(f.daemon.root() + "/rereg/" + VersionDirName(1) + "/" + ShardFileName(0));
  REQUIRE(info.ok());
  REQUIRE(info->items.size() == 1);
  CHECK(info->items[0].name == "only");
  f.CheckStillServing();
}

TEST_CASE("re-registering a new region under an old name snapshots the new memory", "[bad-input]") {
  Fixture f;
  const std::string name = "/ckpt-test-rename-" + std::to_string(::getpid());
  auto first = SharedRegion::create(4096, name);
  std::memset(first->data(), 0x22, 4096);
  Client c = Client::connect(f.daemon.socket());
  c.register_items("rename", 0, 1, {{"w", DType::kU8, {4096}, first, 0}});
  c.snapshot(1);
  c.wait_durable(1);
  // The trainer reallocates: a new object takes the name (the old one is unlinked but alive).
  auto second = SharedRegion::create(4096, name);
  std::memset(second->data(), 0x33, 4096);
  c.register_items("rename", 0, 1, {{"w", DType::kU8, {4096}, second, 0}});
  c.snapshot(2);
  c.wait_durable(2);
  std::string shard = f.daemon.root() + "/rename/" + VersionDirName(2) + "/" + ShardFileName(0);
  REQUIRE(ReadShardItem(shard, "w") == std::string(4096, '\x33'));
  // Dropping the old region object must not remove the name the new one now holds.
  first.reset();
  CHECK(fs::exists("/dev/shm" + name));
  f.CheckStillServing();
}

TEST_CASE("ranks of one job must agree on the world size", "[bad-input]") {
  Fixture f;
  TrainerState a(1, 4096), b(1, 4096);
  Client r0 = Client::connect(f.daemon.socket()), r1 = Client::connect(f.daemon.socket());
  r0.register_items("world", 0, 2, a.Items());
  ExpectError([&] { r1.register_items("world", 1, 3, b.Items()); }, grpc::StatusCode::INVALID_ARGUMENT,
              "job 'world' runs with world size 2 (rank 0), not 3");
  f.CheckStillServing();
}

TEST_CASE("GPU tensors on a daemon without a CUDA device are refused with the reason", "[bad-input][cuda]") {
  Fixture f;
  auto stub = f.daemon.Stub();
  auto table = DescriptorTable::Create("", 4);
  REQUIRE(table.ok());
  // What a client on a GPU node writes: device UUID and the allocation's IPC handle.
  const std::string region = "cuda:" + std::string(32, 'a') + ":" + std::string(128, '0');
  REQUIRE(table->Write({TableItem{"w", DType::kF32, {1024}, region, 0, 4096, 0}}).ok());
  grpc::ClientContext ctx;
  v1::RegisterRequest req;
  req.set_job("gpu");
  req.set_rank(0);
  req.set_world_size(1);
  req.set_descriptor_table(table->name());
  req.mutable_cuda()->set_device_uuid(std::string(32, 'a'));
  req.mutable_cuda()->add_trainer_events(std::string(64, '\0'));
  v1::RegisterReply rep;
  grpc::Status s = stub->Register(&ctx, req, &rep);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("is GPU memory, but this daemon has no CUDA backend") != std::string::npos);
  // Why: this machine has no GPU, or the daemon was built without the CUDA toolkit.
  CHECK((s.error_message().find("no CUDA driver/device") != std::string::npos ||
         s.error_message().find("built without CUDA") != std::string::npos));
  f.CheckStillServing();
}
