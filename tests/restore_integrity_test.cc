// A restore returns good bytes or an error, never a wrong version: a copy on a faster tier
// that fails verification is skipped (and reported) for the next tier, and a shard that is
// not the version, rank or world size asked for is refused, on every reader.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kTensors = 2;
constexpr std::size_t kTensorBytes = 256 << 10;

// A daemon without a memory tier (so restores read files), with a local tier or not.
struct Setup {
  explicit Setup(bool local) : daemon(Options(dir, local)) {}
  static DaemonOptions Options(const TempDir& d, bool local) {
    DaemonOptions o;
    o.root = d.path() + "/root";
    o.socket = d.path() + "/sock/ckptd.sock";
    o.extra_args = {"--memory-mib", "0"};
    if (local) o.extra_args.insert(o.extra_args.end(), {"--local", d.path() + "/local"});
    return o;
  }
  std::string Shard(const std::string& tier, std::uint64_t v) const {
    return dir.path() + "/" + tier + "/job/" + VersionDirName(v) + "/" + ShardFileName(0);
  }
  // Saves versions 1..n (each committed) from one trainer, which then goes away.
  void Save(std::uint64_t n) {
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(daemon.socket());
    c.register_items("job", 0, 1, state.Items());
    for (std::uint64_t v = 1; v <= n; ++v) {
      state.Fill(v);
      c.snapshot(v);
      c.wait_durable(v, Level::kCommitted);
    }
    c.unregister();
  }
  TempDir dir{"integ"};
  DaemonProcess daemon;
};

// Flips one bit of the data section of the shard at `path`, `at` bytes into it.
void FlipDataBit(const std::string& path, std::uint64_t at_data = 1000) {
  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  const std::streamoff at = static_cast<std::streamoff>(info->data_start + at_data);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(at);
  f.write(&c, 1);
  REQUIRE(f.good());
}

}  // namespace

TEST_CASE("a corrupt local-tier copy is skipped: the restore reads the persistent copy", "[restore][tiers]") {
  Setup s(/*local=*/true);
  s.Save(1);
  REQUIRE(fs::exists(s.Shard("local", 1)));
  FlipDataBit(s.Shard("local", 1));

  TrainerState state(kTensors, kTensorBytes, 7);
  state.Fill(99);
  Client c = Client::connect(s.daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  RestoreResult r = c.restore();
  CHECK(r.version == 1);
  CHECK(r.tier == "persistent");
  CHECK(state.FirstMismatch(1) == -1);
  // Reported, and the bad copy is gone from the local tier.
  const std::string status = c.status().json;
  CHECK(status.find("local tier's copy failed verification") != std::string::npos);
  CHECK_FALSE(fs::exists(s.Shard("local", 1)));
  // The persistent copy is intact, and the next restore reads it again.
  CHECK(VerifyShard(s.Shard("root", 1)).ok());
  CHECK(c.restore().tier == "persistent");
}

TEST_CASE(
    "a corrupt persistent copy fails the restore with DATA_LOSS and leaves the trainer's memory as it was",
    "[restore]") {
  Setup s(/*local=*/false);
  s.Save(1);
  // The last tensor is corrupt: a restore that wrote as it verified would have written the
  // first one already.
  FlipDataBit(s.Shard("root", 1), (kTensors - 1) * kTensorBytes + 1000);
  TrainerState state(kTensors, kTensorBytes, 7);
  state.Fill(99);  // what the trainer holds now, e.g. before a rollback it asked for
  Client c = Client::connect(s.daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  try {
    c.restore();
    FAIL("restore of a corrupt shard succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::DATA_LOSS));
    CHECK(std::string(e.what()).find("checksum mismatch in item 't1'") != std::string::npos);
    CHECK(std::string(e.what()).find("nothing was written to the registered regions") != std::string::npos);
  }
  CHECK(state.FirstMismatch(99) == -1);
}

TEST_CASE("a shard copied into another version's directory is refused, not restored as that version",
          "[restore]") {
  Setup s(/*local=*/false);
  s.Save(2);
  fs::copy_file(s.Shard("root", 1), s.Shard("root", 2), fs::copy_options::overwrite_existing);
  TrainerState state(kTensors, kTensorBytes, 7);
  state.Fill(99);
  Client c = Client::connect(s.daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  try {
    c.restore(2);
    FAIL("version 1's shard was restored as version 2");
  } catch (const Error& e) {
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::DATA_LOSS));
    CHECK(std::string(e.what()).find("holds version 1") != std::string::npos);
  }
  CHECK(state.FirstMismatch(99) == -1);  // nothing of the wrong version was written
  CHECK(c.restore(1).version == 1);
  CHECK(state.FirstMismatch(1) == -1);
}

TEST_CASE("a rank or world size beyond 32 bits in a shard's metadata is refused, not truncated",
          "[restore][format]") {
  Setup s(/*local=*/false);
  s.Save(1);
  const std::string path = s.Shard("root", 1);
  for (const char* field : {"ckpt.rank", "ckpt.world_size"}) {
    std::string bytes = ReadFile(path);
    const std::string key = std::string("\"") + field + "\":\"";
    const std::size_t at = bytes.find(key);
    REQUIRE(at != std::string::npos);
    const std::size_t value_at = at + key.size();
    const std::size_t value_end = bytes.find('"', value_at);
    // Same header length: the JSON is padded with spaces before the data.
    const std::string big = "4294967296";
    const std::size_t grow = big.size() - (value_end - value_at);
    const std::size_t pad = bytes.find(std::string(grow, ' '), value_end);
    REQUIRE(pad != std::string::npos);
    std::string patched = bytes;
    patched.erase(pad, grow);
    patched.replace(value_at, value_end - value_at, big);
    REQUIRE(patched.size() == bytes.size());
    const std::string copy = s.dir.path() + "/patched.safetensors";
    std::ofstream(copy, std::ios::binary) << patched;
    auto info = ReadShardHeader(copy);
    INFO(field);
    REQUIRE_FALSE(info.ok());
    CHECK(info.status().code() == StatusCode::kDataLoss);
    CHECK(info.status().message().find("4294967296") != std::string::npos);
  }
}

TEST_CASE("a stray non-canonical version directory does not redirect latest", "[restore][paths]") {
  TempDir dir("integ");
  DaemonOptions o = Setup::Options(dir, /*local=*/false);
  {
    DaemonProcess daemon(o);
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(daemon.socket());
    c.register_items("job", 0, 1, state.Items());
    state.Fill(1);
    c.snapshot(1);
    c.wait_durable(1, Level::kCommitted);
    c.unregister();
    REQUIRE(daemon.Stop() == 0);
  }
  fs::create_directories(o.root + "/job/v3");
  std::ofstream(o.root + "/job/v3/COMMITTED") << "";
  DaemonProcess daemon(o);  // its recovery rescans `latest`
  CHECK(ReadFile(o.root + "/job/latest").find('1') != std::string::npos);
  TrainerState state(kTensors, kTensorBytes, 7);
  Client c = Client::connect(daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  RestoreResult r = c.restore();
  CHECK(r.version == 1);
  CHECK(state.FirstMismatch(1) == -1);
}
