// Restores of checkpoints crafted by the job's owner, who can write its directory: every
// size the daemon reads from a shard header or a marker is bounded before anything of that
// size is allocated. A claim over its limit is a clear error naming the file and the limit
// (never UNKNOWN "Unexpected error in RPC handling"), the daemon's resident memory does not
// grow by the claim, and the daemon goes on serving everyone else.
//
// The claims are cheap to plant: a 2 GiB blob is a hole in a sparse file, with a checksum
// (that of 2 GiB of zeros) that matches, so only a bound on its size refuses it.
#include <ckpt/client.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <vector>

#include "format/checksum.h"
#include "format/markers.h"
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
constexpr std::uint64_t kBigBlob = std::uint64_t{2} << 30;
// What the daemon's resident memory may grow by over a refused restore.
constexpr std::uint64_t kMargin = std::uint64_t{256} << 20;

// xxh3-64 of `bytes` zero bytes.
std::uint64_t ZerosChecksum(std::uint64_t bytes) {
  std::vector<char> zeros(8 << 20, 0);
  Checksum sum;
  for (std::uint64_t done = 0; done < bytes;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(zeros.size(), bytes - done));
    sum.Update(zeros.data(), n);
    done += n;
  }
  return sum.Digest();
}

// Rewrites the shard at `path` with one more item, the blob `name` of `bytes` zero bytes,
// left as a hole of the file. `checksum`: the blob's stored checksum.
void AddSparseBlob(const std::string& path, const std::string& name, std::uint64_t bytes,
                   std::uint64_t checksum) {
  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  const std::string old = ReadFile(path);
  std::vector<ShardItem> items = info->items;
  std::vector<std::string> data;
  for (const ShardItem& it : items) data.push_back(old.substr(info->data_start + it.offset, it.length));
  ShardItem blob;
  blob.name = name;
  blob.kind = ItemKind::kBlob;
  blob.dtype = DType::kU8;
  blob.shape = {static_cast<std::int64_t>(bytes)};
  blob.length = bytes;
  blob.checksum = checksum;
  items.push_back(blob);
  auto layout = ShardLayout::Plan(info->meta, items);
  REQUIRE(layout.ok());
  const std::string header = layout->RenderHeader();
  const std::string tmp = path + ".crafted";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, header.data(), header.size(), 0) == static_cast<ssize_t>(header.size()));
  for (std::size_t i = 0; i < data.size(); ++i) {
    const off_t at = static_cast<off_t>(layout->header_bytes() + layout->items()[i].offset);
    REQUIRE(::pwrite(fd, data[i].data(), data[i].size(), at) == static_cast<ssize_t>(data[i].size()));
  }
  REQUIRE(::ftruncate(fd, static_cast<off_t>(layout->file_bytes())) == 0);
  ::close(fd);
  fs::rename(tmp, path);
  REQUIRE(ReadShardHeader(path).ok());
}

std::vector<TensorItem> Replicated(std::vector<TensorItem> items) {
  for (TensorItem& it : items) {
    Layout l;
    l.replicated = true;
    it.layout = l;
  }
  return items;
}

struct Setup {
  explicit Setup(std::vector<std::string> extra = {}) : daemon(Options(dir, std::move(extra))) {}
  static DaemonOptions Options(const TempDir& d, std::vector<std::string> extra) {
    DaemonOptions o;
    o.root = d.path() + "/root";
    o.socket = d.path() + "/sock/ckptd.sock";
    // No memory tier: restores read the (crafted) files.
    o.extra_args = {"--memory-mib", "0", "--node-id", "node"};
    o.extra_args.insert(o.extra_args.end(), extra.begin(), extra.end());
    return o;
  }
  std::string VersionDir(std::uint64_t v, const std::string& job = "job") const {
    return daemon.root() + "/" + job + "/" + VersionDirName(v);
  }
  std::string Shard(std::uint64_t v, const std::string& job = "job") const {
    return VersionDir(v, job) + "/" + ShardFileName(0);
  }
  // Saves and commits version 1 of `job` from rank 0 of 1 (with replicated layouts if asked).
  void Save(const std::string& job, bool replicated = false) {
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(daemon.socket());
    c.register_items(job, 0, 1, replicated ? Replicated(state.Items()) : state.Items());
    state.Fill(1);
    c.snapshot(1);
    c.wait_durable(1, Level::kCommitted);
    c.unregister();
  }
  // Restores `job` as rank 0 of `world`; the error (code, message), or code 0.
  std::pair<int, std::string> Restore(const std::string& job, std::uint32_t world = 1,
                                      bool replicated = false) {
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(daemon.socket());
    c.register_items(job, 0, world, replicated ? Replicated(state.Items()) : state.Items());
    try {
      c.restore();
      return {0, ""};
    } catch (const Error& e) {
      return {e.code(), e.what()};
    }
  }
  // Another job saves and restores, byte for byte: the daemon still serves.
  void CheckStillServing(const std::string& job) {
    REQUIRE(daemon.running());
    Save(job);
    auto [code, message] = Restore(job);
    INFO(message);
    CHECK(code == 0);
  }

  TempDir dir{"limits"};
  DaemonProcess daemon;
};

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a shard claiming a 2 GiB blob (a hole) is refused before it is allocated", "[limits][restore]") {
  Setup s;
  s.Save("job");
  AddSparseBlob(s.Shard(1), "big", kBigBlob, ZerosChecksum(kBigBlob));
  const std::uint64_t before = s.daemon.PeakRssBytes();
  auto [code, message] = s.Restore("job");
  INFO(message);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(message, s.Shard(1)));
  CHECK(Contains(message, "--max-blob-mib 256"));
  const std::uint64_t after = s.daemon.PeakRssBytes();
  INFO("peak RSS " << (before >> 20) << " MiB -> " << (after >> 20) << " MiB");
  CHECK(after < before + kMargin);
  s.CheckStillServing("other");
}

TEST_CASE("a 2 GiB blob claim is refused at another world size too", "[limits][restore][elastic]") {
  Setup s;
  s.Save("job", /*replicated=*/true);
  AddSparseBlob(s.Shard(1), "big", kBigBlob, ZerosChecksum(kBigBlob));
  const std::uint64_t before = s.daemon.PeakRssBytes();
  auto [code, message] = s.Restore("job", /*world=*/2, /*replicated=*/true);
  INFO(message);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(message, s.Shard(1)));
  CHECK(Contains(message, "--max-blob-mib 256"));
  const std::uint64_t after = s.daemon.PeakRssBytes();
  INFO("peak RSS " << (before >> 20) << " MiB -> " << (after >> 20) << " MiB");
  CHECK(after < before + kMargin);
  s.CheckStillServing("other");
}

TEST_CASE("a blob claim too large to allocate is a clear error, not UNKNOWN", "[limits][restore]") {
  // 8 TiB: no allocation of it can succeed; the file holds it as a hole.
  constexpr std::uint64_t kHuge = std::uint64_t{8} << 40;
  Setup s;
  s.Save("job");
  s.Save("resharded", /*replicated=*/true);
  AddSparseBlob(s.Shard(1), "huge", kHuge, 0);
  AddSparseBlob(s.Shard(1, "resharded"), "huge", kHuge, 0);
  for (const auto& [job, world] : {std::pair<std::string, std::uint32_t>{"job", 1}, {"resharded", 2}}) {
    INFO(job);
    auto [code, message] = s.Restore(job, world, /*replicated=*/job == "resharded");
    INFO(message);
    CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
    CHECK_FALSE(Contains(message, "Unexpected error"));
    CHECK(Contains(message, s.Shard(1, job)));
    CHECK(Contains(message, "--max-blob-mib"));
  }
  s.CheckStillServing("other");
}

TEST_CASE("a COMMITTED marker naming world size 2^22 is refused before it is allocated",
          "[limits][restore]") {
  Setup s;
  s.Save("job");
  const std::string marker = s.VersionDir(1) + "/" + std::string(kCommittedMarker);
  CommittedMarker m{"job", 1, 1u << 22, static_cast<std::int64_t>(std::time(nullptr))};
  std::ofstream(marker, std::ios::trunc) << RenderCommitted(m);
  const std::uint64_t before = s.daemon.PeakRssBytes();
  auto [code, message] = s.Restore("job");
  INFO(message);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(message, marker));
  CHECK(Contains(message, "4194304"));
  CHECK(Contains(message, "1048576"));
  const std::uint64_t after = s.daemon.PeakRssBytes();
  INFO("peak RSS " << (before >> 20) << " MiB -> " << (after >> 20) << " MiB");
  CHECK(after < before + kMargin);
  s.CheckStillServing("other");
}

TEST_CASE("the blobs of all the shards a rank restores at another world size are bounded together",
          "[limits][restore][elastic]") {
  // Each rank's blob is within --max-blob-mib 1, the two together are not.
  Setup s({"--max-blob-mib", "1"});
  const std::string blob(600 << 10, 'b');
  {
    TrainerState r0(kTensors, kTensorBytes, 7), r1(kTensors, kTensorBytes, 7);
    Client c0 = Client::connect(s.daemon.socket()), c1 = Client::connect(s.daemon.socket());
    c0.register_items("job", 0, 2, Replicated(r0.Items()));
    c1.register_items("job", 1, 2, Replicated(r1.Items()));
    r0.Fill(1);
    r1.Fill(1);
    c0.snapshot(1, {Blob{"state", blob}});
    c1.snapshot(1, {Blob{"state", blob}});
    c0.wait_durable(1, Level::kCommitted);
    c1.wait_durable(1, Level::kCommitted);
    c0.unregister();
    c1.unregister();
  }
  // At the same world size a rank gets its own blob: within the limit.
  auto [same_code, same_message] = s.Restore("job", /*world=*/2, /*replicated=*/true);
  INFO(same_message);
  CHECK(same_code == 0);
  auto [code, message] = s.Restore("job", /*world=*/1, /*replicated=*/true);
  INFO(message);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(message, "total " + std::to_string(2 * blob.size()) + " bytes over its shards"));
  CHECK(Contains(message, "--max-blob-mib 1"));
  s.CheckStillServing("other");
}
