// The daemon's data path driven directly, without gRPC: HostPool, ShardJob, and the
// snapshot and flush engines writing real shard files through a Storage that tests wrap
// to inject failures.
#include <sys/stat.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend/device_copier.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/flush_engine.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/pipeline/item_hasher.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/pipeline/snapshot_engine.h"
#include "format/checksum.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "support/byte_pattern.h"
#include "support/fake_device.h"
#include "support/fake_version_sync.h"
#include "support/faulty_storage.h"
#include "support/memory_region.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::Bytes;
using ckpt::test::FakeBackend;
using ckpt::test::FakeDeviceRegion;
using ckpt::test::FakeSync;
using ckpt::test::FaultyStorage;
using ckpt::test::ListFiles;
using ckpt::test::MemoryRegion;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kKiB = 1024;
// Generous bound for things that take milliseconds; reaching it means a hang.
constexpr auto kHang = 30s;

// Pool + flush + snapshot engines, and the outcome of every shard as the callbacks saw it.
class Engines {
 public:
  Engines(std::shared_ptr<Storage> storage, std::uint64_t pool_bytes, std::uint64_t chunk_bytes,
          unsigned writers = 3, unsigned copiers = 2, DeviceBackend* backend = nullptr, unsigned lanes = 2) {
    auto pool = HostPool::Create(pool_bytes, chunk_bytes);
    REQUIRE(pool.ok());
    pool_ = std::move(pool).value();
    flush_ = std::make_unique<FlushEngine>(
        std::move(storage), *pool_, writers, [this](const std::shared_ptr<ShardJob>& s) { Done(s, true); },
        [this](const std::shared_ptr<ShardJob>& s) { Done(s, false); });
    snapshot_ = std::make_unique<SnapshotEngine>(*pool_, *flush_, copiers, backend, lanes);
  }
  ~Engines() { Stop(); }

  // Copies what is queued, writes it, then stops the threads (idempotent).
  void Stop() {
    snapshot_->Stop();
    flush_->Stop();
  }

  HostPool& pool() { return *pool_; }
  void Enqueue(std::shared_ptr<ShardJob> shard) { snapshot_->Enqueue(std::move(shard)); }
  void ReclaimAbandoned() { snapshot_->ReclaimAbandoned(); }

  // Waits until a callback reported `shard` (after which its files are final) and, for a
  // durable one, until its waiters were woken (the callback runs first); returns true if it
  // became durable, false if it failed. Fails the test on a hang.
  bool Outcome(const std::shared_ptr<ShardJob>& shard) {
    bool durable;
    {
      std::unique_lock lock(mu_);
      bool reported = cv_.wait_for(lock, kHang, [&] { return outcome_.count(shard) > 0; });
      REQUIRE(reported);
      durable = outcome_[shard];
    }
    if (durable) REQUIRE(shard->WaitFor(Level::kPersisted, std::chrono::steady_clock::now() + kHang).ok());
    return durable;
  }
  int callbacks(const std::shared_ptr<ShardJob>& shard) {
    std::lock_guard lock(mu_);
    return static_cast<int>(calls_.count(shard));
  }

 private:
  void Done(const std::shared_ptr<ShardJob>& shard, bool durable) {
    {
      std::lock_guard lock(mu_);
      outcome_[shard] = durable;
      calls_.insert(shard);
    }
    cv_.notify_all();
  }

  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<FlushEngine> flush_;
  std::unique_ptr<SnapshotEngine> snapshot_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Keyed by the shard itself, which this keeps alive, so that a later shard allocated at
  // the same address cannot be mistaken for a finished one.
  std::map<std::shared_ptr<ShardJob>, bool> outcome_;
  std::multiset<std::shared_ptr<ShardJob>> calls_;
};

struct ItemSpec {
  std::string name;
  ItemKind kind;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t region_offset = 0;  // tensors
};

// A shard of items taken from `region` (tensors) and from blob bytes, with the bytes each
// item must hold in the file.
struct TestShard {
  std::shared_ptr<ShardJob> job;
  std::vector<std::string> expected;  // per item, in plan order
  std::string data;                   // the whole data section
};

// With `planned` false the layout is left for the copy thread to plan, as the daemon does.
// `placement` gives the device, sync and copy queue (its dir and direct_io are set here).
TestShard MakeShard(const std::string& version_dir, std::shared_ptr<MemoryRegion> region,
                    const std::vector<ItemSpec>& specs, bool direct, std::uint32_t rank = 0,
                    std::uint32_t world = 1, bool planned = true, ShardPlacement placement = {}) {
  placement.dir = version_dir;
  placement.direct_io = direct;
  std::vector<ShardItem> items;
  std::vector<ItemSource> sources;
  TestShard out;
  std::uint32_t seed = 100 + rank;
  for (const auto& spec : specs) {
    ShardItem item;
    item.name = spec.name;
    item.kind = spec.kind;
    item.dtype = spec.dtype;
    item.shape = spec.shape;
    std::uint64_t n = 1;
    for (auto d : spec.shape) n *= static_cast<std::uint64_t>(d);
    item.length = n * DTypeSize(spec.dtype);
    if (spec.kind == ItemKind::kBlob) {
      auto blob = std::make_shared<const std::string>(Bytes(item.length, seed++));
      out.expected.push_back(*blob);
      sources.push_back(ItemSource{nullptr, 0, blob});
    } else {
      REQUIRE(spec.region_offset + item.length <= region->bytes().size());
      out.expected.push_back(region->bytes().substr(spec.region_offset, item.length));
      sources.push_back(ItemSource{region, spec.region_offset, nullptr});
    }
    items.push_back(std::move(item));
  }
  for (const auto& e : out.expected) out.data += e;
  ShardMeta meta{"engine-job", 7, rank, world, ""};
  if (!planned) {
    out.job = std::make_shared<ShardJob>(ShardLayout::Unplanned(meta, std::move(items)), std::move(sources),
                                         std::move(placement));
    return out;
  }
  auto layout = ShardLayout::Plan(meta, std::move(items));
  REQUIRE(layout.ok());
  out.job = std::make_shared<ShardJob>(std::move(layout).value(), std::move(sources), std::move(placement));
  return out;
}

// Items of a few kinds and sizes: unaligned lengths, an empty tensor, a scalar, blobs.
std::vector<ItemSpec> MixedItems() {
  return {
      {"layers.0.attn.weight", ItemKind::kTensor, DType::kF32, {48, 40}, 0},
      {"layers.0.attn.bias", ItemKind::kTensor, DType::kBF16, {7}, 9000},
      {"optimizer.param_groups", ItemKind::kBlob, DType::kU8, {1001}, 0},
      {"empty", ItemKind::kTensor, DType::kF16, {0}, 0},
      {"step", ItemKind::kTensor, DType::kI64, {}, 9100},
      {"layers.1.mlp.weight", ItemKind::kTensor, DType::kU8, {200 * 1024 + 3}, 10000},
      {"rng", ItemKind::kBlob, DType::kU8, {16}, 0},
  };
}

std::shared_ptr<MemoryRegion> Region(std::uint64_t bytes, std::uint32_t seed = 1) {
  return std::make_shared<MemoryRegion>("/ckpt-test-region", Bytes(bytes, seed));
}

// The shard file holds exactly what the test put in, and says so itself.
void CheckShardFile(const TestShard& shard) {
  ShardJob& job = *shard.job;
  const std::string& path = job.final_path();
  INFO(path);
  REQUIRE(fs::exists(path));
  CHECK_FALSE(fs::exists(job.tmp_path()));
  Status verified = VerifyShard(path);
  INFO(verified.message());
  REQUIRE(verified.ok());
  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  CHECK(info->meta.job == "engine-job");
  CHECK(info->meta.version == 7);
  CHECK(info->meta.rank == job.meta().rank);
  REQUIRE(info->items.size() == shard.expected.size());
  std::string file = ReadFile(path);
  CHECK(file.size() == job.layout().file_bytes());
  REQUIRE(info->data_start % kDataAlignment == 0);
  CHECK(file.substr(info->data_start) == shard.data);
  for (std::size_t i = 0; i < info->items.size(); ++i) {
    INFO(info->items[i].name);
    CHECK(info->items[i].checksum == Checksum::Of(shard.expected[i].data(), shard.expected[i].size()));
  }
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}

// The direct-I/O settings this machine can test in `dir`.
std::vector<bool> DirectModes(const std::string& dir) {
  std::vector<bool> modes = {false};
  if (PosixStorage().SupportsDirectIo(dir)) modes.push_back(true);
  return modes;
}

}  // namespace

TEST_CASE("HostPool hands out distinct aligned chunks and counts what is on loan", "[pool]") {
  auto created = HostPool::Create(4 * 64 * kKiB, 64 * kKiB);
  REQUIRE(created.ok());
  HostPool& pool = *created.value();
  CHECK(pool.chunk_bytes() == 64 * kKiB);
  CHECK(pool.pool_bytes() == 4 * 64 * kKiB);
  CHECK(pool.used_bytes() == 0);
  std::vector<HostPool::Chunk> chunks;
  std::set<std::uint32_t> indexes;
  for (int i = 0; i < 4; ++i) {
    auto c = pool.Acquire();
    REQUIRE(c.has_value());
    CHECK(reinterpret_cast<std::uintptr_t>(c->data) % 4096 == 0);
    std::memset(c->data, i, 64 * kKiB);  // the whole chunk is writable
    indexes.insert(c->index);
    chunks.push_back(*c);
    CHECK(pool.used_bytes() == (i + 1) * 64 * kKiB);
  }
  CHECK(indexes.size() == 4);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    for (std::size_t j = i + 1; j < chunks.size(); ++j) {
      auto a = chunks[i].data;
      auto b = chunks[j].data;
      CHECK((a + 64 * kKiB <= b || b + 64 * kKiB <= a));
    }
    CHECK(chunks[i].data[64 * kKiB - 1] == static_cast<char>(i));  // no chunk overwrote another
  }
  for (const auto& c : chunks) pool.Release(c);
  CHECK(pool.used_bytes() == 0);
}

TEST_CASE("HostPool::Create refuses chunks it cannot align or fit", "[pool]") {
  CHECK(HostPool::Create(1 << 20, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(HostPool::Create(1 << 20, 1000).status().code() == StatusCode::kInvalidArgument);
  CHECK(HostPool::Create(4096, 8192).status().code() == StatusCode::kInvalidArgument);
  auto rounded = HostPool::Create(3 * 4096 + 100, 4096);
  REQUIRE(rounded.ok());
  CHECK(rounded.value()->pool_bytes() == 3 * 4096);
}

TEST_CASE("HostPool::Acquire blocks while the pool is empty and resumes on Release", "[pool]") {
  auto created = HostPool::Create(4096, 4096);
  REQUIRE(created.ok());
  HostPool& pool = *created.value();
  auto held = pool.Acquire();
  REQUIRE(held.has_value());

  std::promise<void> about_to_acquire;
  std::promise<std::optional<HostPool::Chunk>> acquired;
  auto got = acquired.get_future();
  std::thread waiter([&] {
    about_to_acquire.set_value();
    acquired.set_value(pool.Acquire());
  });
  about_to_acquire.get_future().wait();
  // The waiter is in (or about to enter) Acquire with nothing free: it must not return.
  CHECK(got.wait_for(50ms) == std::future_status::timeout);
  CHECK(pool.used_bytes() == 4096);

  pool.Release(*held);
  REQUIRE(got.wait_for(kHang) == std::future_status::ready);
  auto chunk = got.get();
  waiter.join();
  REQUIRE(chunk.has_value());
  CHECK(chunk->index == held->index);
  CHECK(chunk->data == held->data);
  CHECK(pool.used_bytes() == 4096);
  pool.Release(*chunk);
}

TEST_CASE("HostPool::Shutdown wakes a blocked Acquire with nothing", "[pool]") {
  auto created = HostPool::Create(4096, 4096);
  REQUIRE(created.ok());
  HostPool& pool = *created.value();
  auto held = pool.Acquire();
  REQUIRE(held.has_value());
  std::promise<void> about_to_acquire;
  std::promise<std::optional<HostPool::Chunk>> acquired;
  auto got = acquired.get_future();
  std::thread waiter([&] {
    about_to_acquire.set_value();
    acquired.set_value(pool.Acquire());
  });
  about_to_acquire.get_future().wait();
  pool.Shutdown();
  REQUIRE(got.wait_for(kHang) == std::future_status::ready);
  CHECK_FALSE(got.get().has_value());
  waiter.join();
  pool.Release(*held);
  CHECK_FALSE(pool.Acquire().has_value());  // even with a chunk free again
}

TEST_CASE("ShardJob levels only rise, the first failure sticks, waits end", "[shard]") {
  auto layout = ShardLayout::Plan(ShardMeta{"j", 3, 0, 1, ""}, {});
  REQUIRE(layout.ok());
  ShardJob job(std::move(layout).value(), {}, "/nonexistent/j/v0000000003", false);
  CHECK(job.final_path() == "/nonexistent/j/v0000000003/rank-00000.safetensors");
  // The temporary name is the final name plus a suffix unique to this shard object.
  CHECK(job.tmp_path().rfind(job.final_path() + ".", 0) == 0);
  CHECK(job.tmp_path().size() > job.final_path().size() + 4);
  CHECK(job.tmp_path().substr(job.tmp_path().size() - 4) == ".tmp");
  ShardJob twin(ShardLayout::Unplanned(ShardMeta{"j", 3, 0, 1, ""}, {}), {}, "/nonexistent/j/v0000000003",
                false);
  CHECK(twin.tmp_path() != job.tmp_path());
  CHECK(job.level() == Level::kNone);

  auto past = std::chrono::steady_clock::now();
  CHECK(job.WaitFor(Level::kCaptured, past).code() == StatusCode::kDeadlineExceeded);
  job.Reach(Level::kPersisted);
  job.Reach(Level::kCaptured);
  CHECK(job.level() == Level::kPersisted);
  CHECK(job.WaitFor(Level::kCaptured, past).ok());
  CHECK(job.WaitFor(Level::kPersisted, past).ok());
  CHECK(job.WaitFor(Level::kCommitted, past).code() == StatusCode::kDeadlineExceeded);

  CHECK_FALSE(job.failed());
  job.Fail(IoError("first", EIO));
  job.Fail(IoError("second", ENOSPC));
  CHECK(job.failed());
  CHECK(job.error().code() == StatusCode::kIoError);
  CHECK_THAT(job.error().message(), Catch::StartsWith("first"));
  CHECK(job.level() == Level::kPersisted);  // a failure does not lower the level
  CHECK_THAT(job.WaitFor(Level::kCommitted, past).message(), Catch::StartsWith("first"));
}

TEST_CASE("ShardJob::WaitFor wakes when another thread reaches the level or fails", "[shard]") {
  auto layout = ShardLayout::Plan(ShardMeta{"j", 3, 0, 1, ""}, {});
  REQUIRE(layout.ok());
  ShardJob job(std::move(layout).value(), {}, "/nonexistent", false);
  auto deadline = std::chrono::steady_clock::now() + kHang;
  std::promise<void> waiting;
  std::thread t([&] {
    waiting.get_future().wait();
    job.Reach(Level::kCaptured);
  });
  waiting.set_value();
  CHECK(job.WaitFor(Level::kCaptured, deadline).ok());
  t.join();
  std::thread f([&] { job.Fail(IoError("boom", EIO)); });
  CHECK(job.WaitFor(Level::kPersisted, deadline).code() == StatusCode::kIoError);
  f.join();
}

TEST_CASE("ShardJob write accounting elects exactly one finisher", "[shard]") {
  auto layout = ShardLayout::Plan(ShardMeta{"j", 3, 0, 1, ""}, {});
  REQUIRE(layout.ok());
  SECTION("writes finish after the copy") {
    ShardJob job(std::move(layout).value(), {}, "/nonexistent", false);
    job.AddPendingWrite();
    job.AddPendingWrite();
    CHECK_FALSE(job.WriteDone());
    CHECK_FALSE(job.CopyDone());
    CHECK(job.WriteDone());
  }
  SECTION("the copy finishes after the writes") {
    ShardJob job(std::move(layout).value(), {}, "/nonexistent", false);
    job.AddPendingWrite();
    CHECK_FALSE(job.WriteDone());
    CHECK(job.CopyDone());
  }
  SECTION("no writes at all") {
    ShardJob job(std::move(layout).value(), {}, "/nonexistent", false);
    CHECK(job.CopyDone());
  }
}

TEST_CASE("the engines write a shard of tensors and blobs that verifies and holds the bytes", "[engine]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    INFO("direct_io=" << direct);
    std::string vdir = dir.path() + "/root/engine-job/" + VersionDirName(7) + (direct ? "d" : "b");
    auto storage = std::make_shared<FaultyStorage>();
    Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
    auto region = Region(512 * kKiB);
    TestShard shard = MakeShard(vdir, region, MixedItems(), direct);
    engines.Enqueue(shard.job);
    REQUIRE(shard.job->WaitFor(Level::kPersisted, std::chrono::steady_clock::now() + kHang).ok());
    REQUIRE(engines.Outcome(shard.job));
    CHECK(engines.callbacks(shard.job) == 1);
    CHECK(shard.job->level() == Level::kPersisted);
    CHECK(shard.job->copied_bytes.load() == shard.data.size());
    CHECK(shard.job->written_bytes.load() == shard.data.size());
    CHECK(engines.pool().used_bytes() == 0);
    CheckShardFile(shard);
    CHECK(storage->datasync_calls.load() >= 1);
    CHECK(ListFiles(vdir) == std::vector<std::string>{ShardFileName(0)});
  }
}

TEST_CASE("a shard left unplanned is planned on the copy thread", "[engine]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(512 * kKiB);
  TestShard shard = MakeShard(dir.path() + "/v", region, MixedItems(), false, 0, 1, /*planned=*/false);
  REQUIRE_FALSE(shard.job->layout().planned());
  CHECK(shard.job->data_bytes() == shard.data.size());
  engines.Enqueue(shard.job);
  REQUIRE(engines.Outcome(shard.job));
  CHECK(shard.job->layout().planned());
  CheckShardFile(shard);
}

TEST_CASE("the shards a Snapshot call lets go are freed by the copy thread once the new one is captured",
          "[engine][retire]") {
  // Freeing a shard frees its item list, thousands of names and shapes: the Snapshot call
  // hands the shards it stops holding to the new shard's copy thread (ShardJob::Retire).
  // First, so that they outlive every shard of the test.
  std::mutex mu;
  std::optional<std::thread::id> freed_on;
  Level next_level_then = Level::kNone;
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(512 * kKiB);
  TestShard next = MakeShard(dir.path() + "/v8", region, MixedItems(), false, 0, 1, /*planned=*/false);
  {
    // An older shard that still holds a source (never copied), whose bytes tell when and
    // where the shard goes.
    ShardJob* watched = next.job.get();
    auto bytes = std::shared_ptr<const std::string>(new std::string(16, 'x'), [&](const std::string* b) {
      std::lock_guard lock(mu);
      freed_on = std::this_thread::get_id();
      next_level_then = watched->level();
      delete b;
    });
    ShardItem blob;
    blob.name = "older";
    blob.kind = ItemKind::kBlob;
    blob.shape = {16};
    blob.length = 16;
    auto layout = ShardLayout::Plan(ShardMeta{"engine-job", 6, 0, 1, ""}, {blob});
    REQUIRE(layout.ok());
    auto older = std::make_shared<ShardJob>(
        std::move(layout).value(), std::vector<ItemSource>{{nullptr, 0, bytes}}, dir.path() + "/v6", false);
    bytes.reset();
    next.job->Retire({std::move(older), nullptr});
  }
  {
    std::lock_guard lock(mu);
    CHECK_FALSE(freed_on.has_value());  // the new shard holds it until its copy thread lets go
  }
  engines.Enqueue(next.job);
  REQUIRE(engines.Outcome(next.job));
  std::lock_guard lock(mu);
  REQUIRE(freed_on.has_value());
  CHECK(*freed_on != std::this_thread::get_id());
  CHECK(next_level_then >= Level::kCaptured);
  CHECK(next.job->TakeRetired().empty());
  CheckShardFile(next);
}

TEST_CASE("ShardRegistry::Add returns the shard it stops holding strongly", "[engine][retire]") {
  ShardRegistry registry;
  std::vector<std::shared_ptr<ShardJob>> shards;
  for (std::size_t i = 0; i <= ShardRegistry::kRecentShards; ++i) {
    auto layout = ShardLayout::Plan(ShardMeta{"registry-job", i + 1, 0, 1, ""}, {});
    REQUIRE(layout.ok());
    shards.push_back(std::make_shared<ShardJob>(std::move(layout).value(), std::vector<ItemSource>{},
                                                "/nonexistent", false));
  }
  for (std::size_t i = 0; i < ShardRegistry::kRecentShards; ++i) CHECK(registry.Add(shards[i]) == nullptr);
  CHECK(registry.Add(shards.back()) == shards.front());
  CHECK(registry.Recent().size() == ShardRegistry::kRecentShards);
  CHECK(registry.Recent().front() == shards[1]);
}

TEST_CASE("a shard whose plan fails on the copy thread fails without a file", "[engine][faults]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(512 * kKiB);
  std::vector<ItemSpec> items = MixedItems();
  items.push_back({"layers.0.attn.bias", ItemKind::kTensor, DType::kU8, {3}, 0});  // a second one
  TestShard shard = MakeShard(dir.path() + "/v", region, items, false, 0, 1, /*planned=*/false);
  engines.Enqueue(shard.job);
  REQUIRE_FALSE(engines.Outcome(shard.job));
  CHECK(shard.job->error().code() == StatusCode::kAlreadyExists);
  CHECK_THAT(shard.job->error().message(), Catch::Contains("layers.0.attn.bias"));
  CHECK(region->reads() == 0);
  CHECK(storage->write_calls.load() == 0);
  CHECK_FALSE(fs::exists(shard.job->final_path()));
  CHECK_FALSE(fs::exists(shard.job->tmp_path()));
}

TEST_CASE("the engines handle shards with no data and items that end on chunk boundaries", "[engine]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    INFO("direct_io=" << direct);
    auto storage = std::make_shared<FaultyStorage>();
    Engines engines(storage, 2 * 64 * kKiB, 64 * kKiB);
    auto region = Region(256 * kKiB);
    std::string base = dir.path() + (direct ? "/d" : "/b");
    std::vector<std::vector<ItemSpec>> cases = {
        {},
        {{"empty", ItemKind::kTensor, DType::kF32, {0}, 0}},
        {{"one.chunk", ItemKind::kTensor, DType::kU8, {64 * 1024}, 0}},
        {{"a", ItemKind::kTensor, DType::kU8, {64 * 1024 - 1}, 0},
         {"b", ItemKind::kTensor, DType::kU8, {1}, 7},
         {"c", ItemKind::kTensor, DType::kF64, {8192}, 64 * 1024}},
        {{"exactly.two.blocks", ItemKind::kBlob, DType::kU8, {8192}, 0}},
    };
    for (std::size_t i = 0; i < cases.size(); ++i) {
      INFO("case " << i);
      TestShard shard = MakeShard(base + "/v" + std::to_string(i), region, cases[i], direct);
      engines.Enqueue(shard.job);
      REQUIRE(engines.Outcome(shard.job));
      CheckShardFile(shard);
    }
  }
}

TEST_CASE("a shard far larger than the pool completes: copies wait for writes", "[engine]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    INFO("direct_io=" << direct);
    auto storage = std::make_shared<FaultyStorage>();
    storage->gate_writes = true;  // nothing leaves the pool until the gate opens
    const std::uint64_t pool_bytes = 4 * 64 * kKiB;
    Engines engines(storage, pool_bytes, 64 * kKiB, 2, 1);
    // Opens the gate before the engines stop, even when a check below throws.
    struct OpenGateOnExit {
      FaultyStorage& storage;
      ~OpenGateOnExit() { storage.OpenGate(); }
    } open_gate_on_exit{*storage};
    auto region = Region(1024 * kKiB + 4096, 3);
    std::vector<ItemSpec> items = {
        {"big.0", ItemKind::kTensor, DType::kF32, {128 * 1024}, 0},
        {"big.1", ItemKind::kTensor, DType::kU8, {512 * 1024 + 77}, 512 * 1024},
        {"tail", ItemKind::kBlob, DType::kU8, {12345}, 0},
    };
    TestShard shard = MakeShard(dir.path() + (direct ? "/d" : "/b"), region, items, direct);
    REQUIRE(shard.data.size() > 4 * pool_bytes);
    engines.Enqueue(shard.job);
    // With every write held, the copy cannot get further than the pool holds.
    Status early = shard.job->WaitFor(Level::kCaptured, std::chrono::steady_clock::now() + 100ms);
    CHECK(early.code() == StatusCode::kDeadlineExceeded);
    CHECK(shard.job->copied_bytes.load() <= pool_bytes);
    CHECK(engines.pool().used_bytes() <= pool_bytes);
    storage->OpenGate();
    REQUIRE(engines.Outcome(shard.job));
    CHECK(shard.job->level() == Level::kPersisted);
    CHECK(storage->write_calls.load() >= static_cast<int>(shard.data.size() / (64 * kKiB)));
    CHECK(engines.pool().used_bytes() == 0);
    CheckShardFile(shard);
  }
}

TEST_CASE("ENOSPC on a write fails the shard, removes its .tmp and publishes nothing", "[engine][faults]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    // 1 MiB in 64 KiB chunks is 16 data writes, then the header: fail early, mid-way, or
    // on the header write when every data byte is already out.
    for (int nth : {1, 3, 17}) {
      INFO("direct_io=" << direct << " failing write #" << nth);
      auto storage = std::make_shared<FaultyStorage>();
      storage->fail_write_on = nth;
      storage->write_errno = ENOSPC;
      Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
      auto region = Region(1024 * kKiB);
      std::string vdir = dir.path() + "/v" + std::to_string(nth) + (direct ? "d" : "b");
      TestShard shard =
          MakeShard(vdir, region, {{"w", ItemKind::kTensor, DType::kU8, {1024 * 1024}, 0}}, direct);
      engines.Enqueue(shard.job);
      Status s = shard.job->WaitFor(Level::kPersisted, std::chrono::steady_clock::now() + kHang);
      REQUIRE_FALSE(engines.Outcome(shard.job));
      CHECK(engines.callbacks(shard.job) == 1);
      INFO(s.message());
      CHECK(s.code() == StatusCode::kResourceExhausted);
      CHECK_THAT(s.message(), Catch::Contains("No space left"));
      CHECK(shard.job->failed());
      CHECK(shard.job->level() < Level::kPersisted);
      CHECK_FALSE(fs::exists(shard.job->tmp_path()));
      CHECK_FALSE(fs::exists(shard.job->final_path()));
      CHECK(storage->renames.load() == 0);
      CHECK(engines.pool().used_bytes() == 0);  // every chunk came back
    }
  }
}

TEST_CASE("a failed shard leaves the other shards of its version alone", "[engine][faults]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  storage->fail_only_path = ShardFileName(1);
  storage->fail_write_on = 2;
  storage->write_errno = EIO;
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(512 * kKiB);
  std::string vdir = dir.path() + "/engine-job/" + VersionDirName(7);
  std::vector<TestShard> shards;
  for (std::uint32_t rank = 0; rank < 3; ++rank) {
    shards.push_back(MakeShard(
        vdir, region, {{"w", ItemKind::kTensor, DType::kU8, {300 * 1024}, rank * 1000}}, false, rank, 3));
    engines.Enqueue(shards.back().job);
  }
  CHECK(engines.Outcome(shards[0].job));
  CHECK_FALSE(engines.Outcome(shards[1].job));
  CHECK(engines.Outcome(shards[2].job));
  CHECK(shards[1].job->error().code() == StatusCode::kIoError);
  CHECK_THAT(shards[1].job->error().message(), Catch::Contains("Input/output error"));
  CheckShardFile(shards[0]);
  CheckShardFile(shards[2]);
  CHECK(ListFiles(vdir) == std::vector<std::string>{ShardFileName(0), ShardFileName(2)});
}

TEST_CASE("EIO on fdatasync fails the shard and publishes nothing", "[engine][faults]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    INFO("direct_io=" << direct);
    auto storage = std::make_shared<FaultyStorage>();
    storage->datasync_errno = EIO;
    Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
    auto region = Region(256 * kKiB);
    std::string vdir = dir.path() + (direct ? "/d" : "/b");
    TestShard shard = MakeShard(vdir, region, MixedItems(), direct);
    engines.Enqueue(shard.job);
    REQUIRE_FALSE(engines.Outcome(shard.job));
    Status s = shard.job->error();
    INFO(s.message());
    CHECK(s.code() == StatusCode::kIoError);
    CHECK_THAT(s.message(), Catch::Contains("fdatasync"));
    CHECK(storage->datasync_calls.load() == 1);
    CHECK(storage->renames.load() == 0);
    CHECK_FALSE(fs::exists(shard.job->tmp_path()));
    CHECK_FALSE(fs::exists(shard.job->final_path()));
  }
}

TEST_CASE("a shard that fails after its rename leaves no shard file behind", "[engine][faults]") {
  // The directory fsync comes after the rename. If it fails the shard is reported failed,
  // so its file must not stay under the final name, where the commit stage counts it.
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  storage->syncdir_errno = EIO;
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(256 * kKiB);
  TestShard shard = MakeShard(dir.path() + "/v", region, MixedItems(), false);
  engines.Enqueue(shard.job);
  REQUIRE_FALSE(engines.Outcome(shard.job));
  CHECK(shard.job->error().code() == StatusCode::kIoError);
  CHECK_FALSE(fs::exists(shard.job->tmp_path()));
  CHECK_FALSE(fs::exists(shard.job->final_path()));
}

TEST_CASE("a shard whose file cannot be created fails with the reason", "[engine][faults]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  storage->create_errno = EACCES;
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(256 * kKiB);
  TestShard shard = MakeShard(dir.path() + "/v", region, MixedItems(), false);
  engines.Enqueue(shard.job);
  REQUIRE_FALSE(engines.Outcome(shard.job));
  CHECK_THAT(shard.job->error().message(), Catch::Contains("Permission denied"));
  // Copying starts before the file exists (capture never waits for file creation), so some
  // bytes may have been read; none may have been written anywhere.
  CHECK(storage->write_calls.load() == 0);
  CHECK(engines.pool().used_bytes() == 0);
  CHECK_FALSE(fs::exists(shard.job->final_path()));
}

TEST_CASE("a region read error fails the shard and names the item", "[engine][faults]") {
  TempDir dir("eng");
  for (bool direct : DirectModes(dir.path())) {
    INFO("direct_io=" << direct);
    auto storage = std::make_shared<FaultyStorage>();
    Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
    auto region = Region(1024 * kKiB);
    // "layers.1.mlp.weight" covers region bytes 10000.. 10000+200 KiB+3; fail inside it,
    // after more than one chunk of the shard was handed to the writers.
    region->FailReadsFrom(10000 + 150 * 1024);
    TestShard shard = MakeShard(dir.path() + (direct ? "/d" : "/b"), region, MixedItems(), direct);
    engines.Enqueue(shard.job);
    REQUIRE_FALSE(engines.Outcome(shard.job));
    Status s = shard.job->error();
    INFO(s.message());
    CHECK_THAT(s.message(), Catch::Contains("layers.1.mlp.weight"));
    CHECK_THAT(s.message(), Catch::Contains("read region"));
    CHECK(shard.job->level() == Level::kNone);  // never captured
    CHECK_FALSE(fs::exists(shard.job->tmp_path()));
    CHECK_FALSE(fs::exists(shard.job->final_path()));
    CHECK(engines.pool().used_bytes() == 0);
  }
}

TEST_CASE("several shards in flight at once all complete", "[engine]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 6 * 64 * kKiB, 64 * kKiB, 4, 3);
  std::vector<std::shared_ptr<MemoryRegion>> regions;
  std::vector<TestShard> shards;
  for (std::uint32_t rank = 0; rank < 6; ++rank) {
    regions.push_back(Region(400 * kKiB, rank + 10));
    shards.push_back(MakeShard(dir.path() + "/engine-job/" + VersionDirName(7), regions.back(),
                               {{"w", ItemKind::kTensor, DType::kF32, {50 * 1024 + rank}, 0},
                                {"b", ItemKind::kBlob, DType::kU8, {100 + rank}, 0}},
                               false, rank, 6));
    engines.Enqueue(shards.back().job);
  }
  for (const auto& shard : shards) {
    REQUIRE(engines.Outcome(shard.job));
    CheckShardFile(shard);
  }
}

TEST_CASE("stopping the engines finishes the shards already queued", "[engine]") {
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 2 * 64 * kKiB, 64 * kKiB, 2, 1);
  auto region = Region(512 * kKiB);
  std::vector<TestShard> shards;
  for (std::uint32_t rank = 0; rank < 4; ++rank) {
    shards.push_back(MakeShard(dir.path() + "/v", region,
                               {{"w", ItemKind::kTensor, DType::kU8, {200 * 1024}, rank}}, false, rank, 4));
    engines.Enqueue(shards.back().job);
  }
  engines.Stop();
  for (const auto& shard : shards) {
    INFO("rank " << shard.job->meta().rank);
    CHECK(engines.callbacks(shard.job) == 1);  // already reported: Stop waited for it
    CHECK(shard.job->level() == Level::kPersisted);
    CheckShardFile(shard);
  }
}

TEST_CASE("an engine shard passes the independent safetensors spec check", "[engine][spec]") {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) {
    WARN("python3 is not available; the spec check is not run");
    return;
  }
  TempDir dir("eng");
  auto storage = std::make_shared<FaultyStorage>();
  Engines engines(storage, 4 * 64 * kKiB, 64 * kKiB);
  auto region = Region(512 * kKiB);
  TestShard shard =
      MakeShard(dir.path() + "/v", region, MixedItems(), PosixStorage().SupportsDirectIo(dir.path()));
  engines.Enqueue(shard.job);
  REQUIRE(engines.Outcome(shard.job));
  std::string dump = dir.path() + "/dump";
  std::string script = std::string(CKPT_SOURCE_DIR) + "/tests/safetensors_spec_check.py";
  std::string cmd = "python3 '" + script + "' --dump-dir '" + dump + "' '" + shard.job->final_path() + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const auto& items = shard.job->layout().items();
  for (std::size_t i = 0; i < items.size(); ++i) {
    std::string key = items[i].TensorKey();
    for (std::size_t at; (at = key.find('/')) != std::string::npos;) key.replace(at, 1, "%2F");
    INFO(key);
    REQUIRE(fs::exists(dump + "/" + key + ".bin"));
    CHECK(ReadFile(dump + "/" + key + ".bin") == shard.expected[i]);
  }

  // And the checker is not a rubber stamp: one byte less is refused.
  fs::resize_file(shard.job->final_path(), fs::file_size(shard.job->final_path()) - 1);
  cmd = "python3 '" + script + "' '" + shard.job->final_path() + "' >/dev/null 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
}

// ---- device copies, without a device -----------------------------------------------------
//
// The engine's device path (lanes that complete later, the trainer's event before the
// copies, the daemon's completion event after them) driven by a fake device whose "streams"
// are threads running queued operations in order (support/fake_device.h).

namespace {

// A placement on device 0, ordered by `sync` (may be null), in copy queue `queue`.
ShardPlacement OnDevice(std::shared_ptr<VersionSync> sync, std::string queue = "") {
  ShardPlacement p;
  p.device = 0;
  p.sync = std::move(sync);
  p.copy_queue = std::move(queue);
  return p;
}

// A shard of MixedItems from a device region, ordered by `sync`, in copy queue `queue`.
TestShard DeviceShard(const std::string& dir, const std::shared_ptr<FakeDeviceRegion>& region,
                      const std::shared_ptr<FakeSync>& sync, std::string queue = "") {
  return MakeShard(dir, region, MixedItems(), false, 0, 1, /*planned=*/false,
                   OnDevice(sync, std::move(queue)));
}

}  // namespace

TEST_CASE("device copies wait for the trainer's event and capture the state it orders", "[engine][device]") {
  TempDir dir("eng");
  FakeBackend backend;
  Engines engines(std::make_shared<FaultyStorage>(), 8 * 64 * kKiB, 64 * kKiB, 2, 1, &backend, 2);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", Bytes(512 * kKiB, 11));
  auto sync = std::make_shared<FakeSync>(backend.fake);
  // Opens the event before the engines stop, even when a check below throws.
  struct OpenOnExit {
    FakeSync& sync;
    ~OpenOnExit() { sync.trainer_event.Open(); }
  } open_on_exit{*sync};
  // The bytes the trainer's update will have written once its event fires.
  const std::string updated = Bytes(512 * kKiB, 12);
  TestShard shard = DeviceShard(dir.path() + "/v", region, sync);
  engines.Enqueue(shard.job);
  // The first chunk's copies are queued behind the event; nothing has run, and the shard
  // holds that one chunk until the event fires.
  backend.fake.first_copy_queued.Wait();
  CHECK(backend.fake.bytes_done.load() == 0);
  CHECK(shard.job->level() == Level::kNone);
  bool ordered_only = false;
  CHECK(shard.job->WaitOrdered(std::chrono::steady_clock::now(), &ordered_only).code() ==
        StatusCode::kDeadlineExceeded);
  region->Overwrite(updated);
  sync->trainer_event.Open();
  REQUIRE(shard.job->WaitOrdered(std::chrono::steady_clock::now() + kHang, &ordered_only).ok());
  REQUIRE(engines.Outcome(shard.job));
  sync->completion.Wait();
  // The completion event was recorded once every copy was queued, and fired after every
  // byte was copied.
  CHECK(sync->signals.load() == 1);
  CHECK(sync->bytes_queued_at_signal.load() == backend.fake.bytes_queued.load());
  CHECK(sync->bytes_done_at_completion.load() == backend.fake.bytes_queued.load());
  CHECK(sync->gates.load() == 2);  // both lanes had chunks, each gated once
  CHECK(sync->releases.load() >= 1);
  {
    std::lock_guard lock(backend.fake.mu);
    REQUIRE(backend.fake.chunks_per_lane.size() == 2);
    for (auto& [lane, chunks] : backend.fake.chunks_per_lane) CHECK(chunks >= 2);
  }
  // The file holds the updated tensors (and the blobs), not what was there at snapshot.
  TestShard expected = MakeShard(dir.path() + "/x", region, MixedItems(), false);
  shard.expected = expected.expected;
  shard.data = expected.data;
  CheckShardFile(shard);
  CHECK(engines.pool().used_bytes() == 0);
}

TEST_CASE("a device shard larger than the pool streams through it in order", "[engine][device]") {
  TempDir dir("eng");
  FakeBackend backend;
  const std::uint64_t pool_bytes = 3 * 64 * kKiB;
  Engines engines(std::make_shared<FaultyStorage>(), pool_bytes, 64 * kKiB, 2, 1, &backend, 3);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", Bytes(2048 * kKiB, 21));
  auto sync = std::make_shared<FakeSync>(backend.fake);
  std::vector<ItemSpec> items = {
      {"a", ItemKind::kTensor, DType::kU8, {700 * 1024 + 5}, 0},
      {"meta", ItemKind::kBlob, DType::kU8, {333}, 0},
      {"b", ItemKind::kTensor, DType::kF32, {300 * 1024}, 800 * 1024},
  };
  TestShard shard = MakeShard(dir.path() + "/v", region, items, false, 0, 1, false, OnDevice(sync));
  REQUIRE(shard.data.size() > 4 * pool_bytes);
  sync->trainer_event.Open();
  engines.Enqueue(shard.job);
  REQUIRE(engines.Outcome(shard.job));
  CHECK(sync->signals.load() == 1);
  sync->completion.Wait();
  CHECK(sync->bytes_done_at_completion.load() == backend.fake.bytes_queued.load());
  CHECK(backend.fake.lanes_made.load() == 3);
  CheckShardFile(shard);
  CHECK(engines.pool().used_bytes() == 0);
}

TEST_CASE("a device copy that cannot reach its region fails the shard and returns every chunk",
          "[engine][device][faults]") {
  TempDir dir("eng");
  FakeBackend backend;
  Engines engines(std::make_shared<FaultyStorage>(), 8 * 64 * kKiB, 64 * kKiB, 2, 1, &backend, 2);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", Bytes(512 * kKiB, 31));
  region->closed = true;  // the trainer exited and its allocations were released
  auto sync = std::make_shared<FakeSync>(backend.fake);
  sync->trainer_event.Open();
  TestShard shard = DeviceShard(dir.path() + "/v", region, sync);
  engines.Enqueue(shard.job);
  REQUIRE_FALSE(engines.Outcome(shard.job));
  Status err = shard.job->error();
  INFO(err.message());
  CHECK(err.message().find("layers.0.attn.weight") != std::string::npos);
  CHECK(err.message().find("closed") != std::string::npos);
  CHECK(sync->signals.load() == 0);  // no completion event for a failed copy
  CHECK(sync->releases.load() >= 1);
  bool ordered_only = true;
  CHECK_FALSE(shard.job->WaitOrdered(std::chrono::steady_clock::now() + kHang, &ordered_only).ok());
  // What was queued (the wait for the event) drains; then every chunk is back.
  backend.fake.WaitAllIdle();
  engines.ReclaimAbandoned();
  CHECK(engines.pool().used_bytes() == 0);
  CHECK_FALSE(fs::exists(shard.job->final_path()));
}

TEST_CASE("a device shard on a daemon without a device backend fails with the reason",
          "[engine][device][faults]") {
  TempDir dir("eng");
  Engines engines(std::make_shared<FaultyStorage>(), 4 * 64 * kKiB, 64 * kKiB);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", Bytes(512 * kKiB, 41));
  TestShard shard = MakeShard(dir.path() + "/v", region, MixedItems(), false, 0, 1, false, OnDevice(nullptr));
  engines.Enqueue(shard.job);
  REQUIRE_FALSE(engines.Outcome(shard.job));
  CHECK(shard.job->error().message().find("no device backend") != std::string::npos);
}

TEST_CASE("a device shard waiting for its trainer holds one chunk and blocks no other registration",
          "[engine][device]") {
  TempDir dir("eng");
  FakeBackend backend;
  const std::uint64_t chunk = 32 * kKiB;
  // A pool smaller than either shard: a waiting shard that hoarded it would stop the other.
  Engines engines(std::make_shared<FaultyStorage>(), 4 * chunk, chunk, 2, 1, &backend, 2);
  auto region_a = std::make_shared<FakeDeviceRegion>("cuda:a", Bytes(512 * kKiB, 51));
  auto region_b = std::make_shared<FakeDeviceRegion>("cuda:b", Bytes(512 * kKiB, 52));
  auto sync_a = std::make_shared<FakeSync>(backend.fake);
  auto sync_b = std::make_shared<FakeSync>(backend.fake);
  // Opens A's event before the engines stop, even when a check below throws.
  struct OpenOnExit {
    FakeSync& sync;
    ~OpenOnExit() { sync.trainer_event.Open(); }
  } open_on_exit{*sync_a};
  TestShard a = DeviceShard(dir.path() + "/a", region_a, sync_a, "rank-0");
  TestShard b = DeviceShard(dir.path() + "/b", region_b, sync_b, "rank-1");
  REQUIRE(a.data.size() > 4 * chunk);
  engines.Enqueue(a.job);  // its trainer's event has not fired
  sync_a->gated.Wait();
  sync_b->trainer_event.Open();
  engines.Enqueue(b.job);
  REQUIRE(engines.Outcome(b.job));
  CheckShardFile(b);
  // A is still waiting for its event, holding the one chunk it queued.
  CHECK(a.job->level() == Level::kNone);
  CHECK(engines.pool().used_bytes() == chunk);
  sync_a->trainer_event.Open();
  REQUIRE(engines.Outcome(a.job));
  CheckShardFile(a);
  CHECK(engines.pool().used_bytes() == 0);
}

TEST_CASE("a device shard whose trainer exits before its event fires is abandoned without a hang",
          "[engine][device][faults]") {
  TempDir dir("eng");
  FakeBackend backend;
  const std::uint64_t chunk = 32 * kKiB;
  Engines engines(std::make_shared<FaultyStorage>(), 4 * chunk, chunk, 2, 1, &backend, 2);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:a", Bytes(512 * kKiB, 61));
  auto sync = std::make_shared<FakeSync>(backend.fake);
  struct OpenOnExit {
    FakeSync& sync;
    ~OpenOnExit() { sync.trainer_event.Open(); }
  } open_on_exit{*sync};
  TestShard shard = DeviceShard(dir.path() + "/a", region, sync, "rank-0");
  engines.Enqueue(shard.job);
  sync->gated.Wait();
  // What the service does when the trainer's process is gone: the event may never fire.
  shard.job->Fail(FailedPrecondition("trainer exited"));
  backend.fake.PokeAll();
  REQUIRE_FALSE(engines.Outcome(shard.job));
  CHECK(shard.job->error().message() == "trainer exited");
  CHECK(backend.fake.bytes_done.load() == 0);
  // Its chunk is set aside: a copy is still queued into it behind the event.
  CHECK(engines.pool().used_bytes() == chunk);
  // The event fires after all (or the driver drops it); the next copy takes the chunk back.
  sync->trainer_event.Open();
  backend.fake.WaitAllIdle();
  auto next_sync = std::make_shared<FakeSync>(backend.fake);
  next_sync->trainer_event.Open();
  TestShard next =
      DeviceShard(dir.path() + "/b", std::make_shared<FakeDeviceRegion>("cuda:b", Bytes(512 * kKiB, 62)),
                  next_sync, "rank-0");
  engines.Enqueue(next.job);
  REQUIRE(engines.Outcome(next.job));
  CheckShardFile(next);
  CHECK(engines.pool().used_bytes() == 0);
}

namespace {

// Chunks ended (tickets taken) on every lane of `backend`.
std::uint64_t TicketsEnded(FakeBackend& backend) {
  std::lock_guard lock(backend.fake.mu);
  std::uint64_t n = 0;
  for (auto& [lane, chunks] : backend.fake.chunks_per_lane) n += chunks;
  return n;
}

}  // namespace

TEST_CASE("device copies are one per (item ∩ chunk), adjacent items of one allocation sharing one",
          "[engine][device]") {
  TempDir dir("eng");
  constexpr std::uint64_t kMiB = 1024 * kKiB;
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", Bytes(4 * kMiB, 71));
  // "w" and "b" are adjacent in the region (one copy wherever a chunk holds both); "x" is
  // elsewhere and larger than the 1 MiB pieces copies used to be cut into.
  std::vector<ItemSpec> items = {
      {"w", ItemKind::kTensor, DType::kU8, {100 * 1024}, 0},
      {"b", ItemKind::kTensor, DType::kU8, {50 * 1024}, 100 * 1024},
      {"x", ItemKind::kTensor, DType::kU8, {3 * 1024 * 1024 + 5}, 200 * 1024},
      {"meta", ItemKind::kBlob, DType::kU8, {1001}, 0},
  };
  // 4 MiB chunks: the shard is one chunk, with one copy for w+b and one for x. 1 MiB
  // chunks: w+b in chunk 0, and x cut by the chunks: chunk 0's tail, chunks 1 and 2, chunk 3's head.
  const struct { std::uint64_t chunk, copies, chunks; } cases[] = {{4 * kMiB, 2, 1}, {kMiB, 5, 4}};
  for (const auto& c : cases) {
    INFO("chunk " << c.chunk);
    FakeBackend backend;
    Engines engines(std::make_shared<FaultyStorage>(), 4 * c.chunk, c.chunk, 3, 1, &backend, 2);
    auto sync = std::make_shared<FakeSync>(backend.fake);
    sync->trainer_event.Open();
    TestShard shard = MakeShard(dir.path() + "/v" + std::to_string(c.chunk), region, items, false, 0, 1,
                                false, OnDevice(sync));
    engines.Enqueue(shard.job);
    REQUIRE(engines.Outcome(shard.job));
    CHECK(backend.fake.copies_out.load() == c.copies);
    CHECK(TicketsEnded(backend) == c.chunks);
    CHECK(backend.fake.bytes_queued.load() == (150 + 3 * 1024) * 1024 + 5);
    CheckShardFile(shard);  // byte-exact, and each checksum the xxh3-64 of the item's bytes
    CHECK(engines.pool().used_bytes() == 0);
  }
}

// ---- item checksums, hashed by several threads -------------------------------------------

TEST_CASE("ItemHasher gives each item's xxh3-64 whatever the threads and the ranges", "[hasher]") {
  const std::vector<std::uint64_t> lengths = {0, 5000, 1, 0, 70000, 3, 12345, 0};
  std::vector<ShardItem> items;
  std::string data;
  std::vector<std::uint64_t> expected;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    ShardItem it;
    it.name = "i" + std::to_string(i);
    it.length = lengths[i];
    it.offset = data.size();
    const std::string bytes = Bytes(lengths[i], 90 + static_cast<std::uint32_t>(i));
    expected.push_back(Checksum::Of(bytes.data(), bytes.size()));
    data += bytes;
    items.push_back(it);
  }
  for (std::uint64_t range :
       {std::uint64_t{1000}, std::uint64_t{4096}, std::uint64_t{65536}, std::uint64_t{1} << 20}) {
    for (unsigned threads : {1u, 4u}) {
      INFO("range " << range << ", " << threads << " threads");
      for (auto& it : items) it.checksum = 0;
      ItemHasher hasher(items);
      // Ranges are taken in file order, as writers take chunks from their queue, and hashed at once.
      std::mutex mu;
      std::uint64_t next = 0;
      std::atomic<bool> all_true{true};
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&] {
          for (;;) {
            std::uint64_t off;
            {
              std::lock_guard lock(mu);
              if (next >= data.size()) return;
              off = next;
              next += range;
            }
            const std::uint64_t n = std::min<std::uint64_t>(range, data.size() - off);
            if (!hasher.Hash(off, data.data() + off, n)) all_true = false;
          }
        });
      }
      for (auto& t : pool) t.join();
      CHECK(all_true.load());
      for (std::size_t i = 0; i < items.size(); ++i) {
        INFO(items[i].name);
        CHECK(items[i].checksum == expected[i]);
      }
    }
  }
}

TEST_CASE("ItemHasher::Abort ends a wait for an earlier piece that will never be hashed", "[hasher]") {
  std::vector<ShardItem> items(1);
  items[0].name = "big";
  items[0].length = 8192;
  const std::string bytes = Bytes(8192, 3);
  ItemHasher hasher(items);
  // The second half of the item waits for the first, which nobody hashes (its write failed).
  auto second = std::async(std::launch::async, [&] { return hasher.Hash(4096, bytes.data() + 4096, 4096); });
  hasher.Abort();
  REQUIRE(second.wait_for(kHang) == std::future_status::ready);
  CHECK_FALSE(second.get());
  CHECK_FALSE(hasher.Hash(0, bytes.data(), 4096));
}
