// The restore engine driven directly: a shard (file or memory-tier image) restored into
// fake device memory and host memory. A restore verifies every item before it writes a
// byte, so a corrupt shard leaves the regions exactly as they were; device regions get
// asynchronous host-to-device copies, one per (item ∩ chunk), ended by one ticket per
// chunk, and never a synchronous per-piece copy.
#include "daemon/pipeline/restore_engine.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "daemon/io/storage.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/tiers/memory_tier.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "support/byte_pattern.h"
#include "support/fake_device.h"
#include "support/memory_region.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::Bytes;
using ckpt::test::FakeBackend;
using ckpt::test::FakeDeviceRegion;
using ckpt::test::TempDir;
using ckpt::test::WritableRegion;

namespace {

constexpr std::uint64_t kKiB = 1024;
constexpr std::uint64_t kChunk = 64 * kKiB;

struct Item {
  std::string name;
  ItemKind kind;
  std::uint64_t length;
  std::uint64_t region_offset;  // tensors
};

// Tensors of one region (two of them adjacent), a blob between, an empty tensor; lengths
// that cut chunks anywhere. The shard's data section is a little over 6 chunks.
std::vector<Item> Items() {
  return {
      {"a", ItemKind::kTensor, 150 * kKiB + 7, 0},
      {"b", ItemKind::kTensor, 90 * kKiB + 1, 150 * kKiB + 7},
      {"meta", ItemKind::kBlob, 1001, 0},
      {"empty", ItemKind::kTensor, 0, 0},
      {"c", ItemKind::kTensor, 160 * kKiB + 5, 300 * kKiB},
  };
}
constexpr std::uint64_t kRegionBytes = 512 * kKiB;

// A shard written as the daemon writes it, with the bytes of each item.
struct TestShard {
  ShardInfo info;
  std::string file;                   // the whole file
  std::vector<std::string> contents;  // per item
};

TestShard MakeShard() {
  std::vector<ShardItem> items;
  TestShard out;
  std::uint32_t seed = 500;
  for (const auto& spec : Items()) {
    ShardItem item;
    item.name = spec.name;
    item.kind = spec.kind;
    item.dtype = DType::kU8;
    item.shape = {static_cast<std::int64_t>(spec.length)};
    item.length = spec.length;
    out.contents.push_back(Bytes(spec.length, seed++));
    item.checksum = Checksum::Of(out.contents.back().data(), spec.length);
    items.push_back(std::move(item));
  }
  auto layout = ShardLayout::Plan(ShardMeta{"restore-job", 3, 0, 1, ""}, std::move(items));
  REQUIRE(layout.ok());
  out.file = layout->RenderHeader();
  for (const auto& c : out.contents) out.file += c;
  REQUIRE(out.file.size() == layout->file_bytes());
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(out.file[i]);
  auto info = ParseShardHeader(std::string_view(out.file.data() + 8, header_len), out.file.size());
  INFO(info.status().message());
  REQUIRE(info.ok());
  out.info = std::move(info).value();
  return out;
}

// The data-section offset of item `name` in `shard`.
std::uint64_t OffsetOf(const TestShard& shard, const std::string& name) {
  for (const auto& item : shard.info.items) {
    if (item.name == name) return item.offset;
  }
  FAIL("no item " << name);
  return 0;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

// A memory-tier image holding `file` (page aligned, as the tier's are).
struct Image {
  explicit Image(const std::string& file) {
    const std::uint64_t capacity = (file.size() + 4095) / 4096 * 4096;
    data.reset(static_cast<char*>(std::aligned_alloc(4096, capacity)));
    std::memset(data.get(), 0, capacity);
    std::memcpy(data.get(), file.data(), file.size());
    image = std::make_unique<MemoryImage>(ShardMeta{"restore-job", 3, 0, 1, ""}, file.size(), data.get(),
                                          capacity);
  }
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data;
  std::unique_ptr<MemoryImage> image;
};

std::vector<RestoreTarget> Targets(const std::shared_ptr<ImportedRegion>& region) {
  std::vector<RestoreTarget> out;
  for (const auto& spec : Items()) {
    if (spec.kind != ItemKind::kTensor) continue;
    RestoreTarget t;
    t.item.name = spec.name;
    t.item.kind = spec.kind;
    t.item.dtype = DType::kU8;
    t.item.shape = {static_cast<std::int64_t>(spec.length)};
    t.item.length = spec.length;
    t.region = region;
    t.region_offset = spec.region_offset;
    out.push_back(std::move(t));
  }
  return out;
}

// What the region holds after a good restore of `shard` over `before`.
std::string Restored(const TestShard& shard, std::string before) {
  const auto items = Items();
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].kind == ItemKind::kTensor)
      before.replace(items[i].region_offset, items[i].length, shard.contents[i]);
  }
  return before;
}

// The host-to-device copies a restore must queue: one per (tensor item ∩ chunk); and the
// chunks that hold tensor bytes (one ticket each, the data section starting a chunk).
std::uint64_t ExpectedCopies(const TestShard& shard) {
  std::uint64_t n = 0;
  for (const auto& it : shard.info.items) {
    if (it.kind == ItemKind::kTensor && it.length > 0)
      n += (it.offset + it.length - 1) / kChunk - it.offset / kChunk + 1;
  }
  return n;
}
std::uint64_t ExpectedTickets(const TestShard& shard) {
  std::set<std::uint64_t> chunks;
  for (const auto& it : shard.info.items) {
    if (it.kind != ItemKind::kTensor || it.length == 0) continue;
    for (std::uint64_t k = it.offset / kChunk; k <= (it.offset + it.length - 1) / kChunk; ++k)
      chunks.insert(k);
  }
  return chunks.size();
}

std::uint64_t TicketsEnded(FakeBackend& backend) {
  std::lock_guard lock(backend.fake.mu);
  std::uint64_t n = 0;
  for (auto& [lane, chunks] : backend.fake.chunks_per_lane) n += chunks;
  return n;
}

// A pool that holds the whole shard (one pass), or only two chunks (two passes).
struct PoolCase {
  const char* name;
  std::uint64_t chunks;
};
const PoolCase kPools[] = {{"one pass", 16}, {"two passes", 2}, {"two passes after a held prefix", 4}};
// The restores below keep two reads in flight: with fewer chunks than the shard has, the
// pool's chunks but two hold the shard's first chunks, and the rest of it is read twice.
constexpr unsigned kReaders = 2;
std::uint64_t BytesRead(const TestShard& shard, std::uint64_t pool_chunks) {
  const std::uint64_t data = shard.file.size() - shard.info.data_start;
  const std::uint64_t chunks = (data + kChunk - 1) / kChunk;
  if (pool_chunks >= chunks) return data;
  return data + (data - (pool_chunks - std::min<std::uint64_t>(pool_chunks, kReaders)) * kChunk);
}

}  // namespace

TEST_CASE("a restore into device memory is byte-exact, queued per chunk, never synchronous",
          "[restore-engine]") {
  const TestShard shard = MakeShard();
  REQUIRE(shard.file.size() - shard.info.data_start > 6 * kChunk);
  TempDir dir("rst");
  const std::string path = dir.path() + "/shard.safetensors";
  WriteFile(path, shard.file);
  for (const auto& pool_case : kPools) {
    for (bool from_image : {false, true}) {
      INFO(pool_case.name << (from_image ? ", from a memory image" : ", from a file"));
      auto pool = HostPool::Create(pool_case.chunks * kChunk, kChunk);
      REQUIRE(pool.ok());
      FakeBackend backend;
      RestoreEngine engine(std::make_shared<PosixStorage>(), *pool.value(), kReaders, &backend, 2);
      const std::string before = Bytes(kRegionBytes, 7);
      auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", before);
      Image image(shard.file);
      auto restored = from_image ? engine.RestoreFromImage(*image.image, Targets(region))
                                 : engine.Restore(path, Targets(region), false);
      INFO(restored.status().message());
      REQUIRE(restored.ok());
      CHECK(region->bytes() == Restored(shard, before));
      REQUIRE(restored->blobs.size() == 1);
      CHECK(restored->blobs[0].first == "meta");
      CHECK(restored->blobs[0].second == shard.contents[2]);
      // Two passes read again what the pool could not hold; an image is never read from a file.
      CHECK(restored->bytes_read == (from_image ? 0 : BytesRead(shard, pool_case.chunks)));
      // Every copy was queued on a lane, one per (item ∩ chunk), one ticket per chunk; no
      // synchronous write (a CUDA copy then a stream synchronise) happened.
      CHECK(backend.fake.copies_in.load() == ExpectedCopies(shard));
      CHECK(backend.fake.bytes_in_done.load() == restored->tensor_bytes);
      CHECK(TicketsEnded(backend) == ExpectedTickets(shard));
      CHECK(backend.fake.lanes_made.load() == 2);
      CHECK(region->writes() == 0);
      CHECK(pool.value()->used_bytes() == 0);
    }
  }
}

TEST_CASE("a corrupt shard or memory image gives DATA_LOSS and leaves every byte of the regions as it was",
          "[restore-engine]") {
  TestShard shard = MakeShard();
  // The last tensor is corrupt: a restore that wrote as it verified would have written the
  // items before it.
  std::string corrupt = shard.file;
  corrupt[shard.info.data_start + OffsetOf(shard, "c") + 100 * kKiB] ^= 0x10;
  TempDir dir("rst");
  const std::string path = dir.path() + "/shard.safetensors";
  WriteFile(path, corrupt);
  for (const auto& pool_case : kPools) {
    for (bool from_image : {false, true}) {
      for (bool device : {true, false}) {
        INFO(pool_case.name << (from_image ? ", from a memory image" : ", from a file")
                            << (device ? ", into device memory" : ", into host memory"));
        auto pool = HostPool::Create(pool_case.chunks * kChunk, kChunk);
        REQUIRE(pool.ok());
        FakeBackend backend;
        RestoreEngine engine(std::make_shared<PosixStorage>(), *pool.value(), kReaders, &backend, 2);
        const std::string before = Bytes(kRegionBytes, 8);
        std::shared_ptr<WritableRegion> region =
            device ? std::make_shared<FakeDeviceRegion>("cuda:fake", before)
                   : std::make_shared<WritableRegion>("/ckpt-test-region", before);
        Image image(corrupt);
        auto restored = from_image ? engine.RestoreFromImage(*image.image, Targets(region))
                                   : engine.Restore(path, Targets(region), false);
        REQUIRE_FALSE(restored.ok());
        const std::string message = restored.status().message();
        INFO(message);
        CHECK(restored.status().code() == StatusCode::kDataLoss);
        CHECK_THAT(message, Catch::Contains("checksum mismatch in item 'c'"));
        CHECK_THAT(message, Catch::Contains("nothing was written to the registered regions"));
        // Every byte as it was; no copy was even queued.
        CHECK(region->bytes() == before);
        CHECK(region->writes() == 0);
        CHECK(backend.fake.copies_in.load() == 0);
        CHECK(pool.value()->used_bytes() == 0);
      }
    }
  }
}

TEST_CASE("a restore into host memory is byte-exact", "[restore-engine]") {
  const TestShard shard = MakeShard();
  TempDir dir("rst");
  const std::string path = dir.path() + "/shard.safetensors";
  WriteFile(path, shard.file);
  for (const auto& pool_case : kPools) {
    INFO(pool_case.name);
    auto pool = HostPool::Create(pool_case.chunks * kChunk, kChunk);
    REQUIRE(pool.ok());
    RestoreEngine engine(std::make_shared<PosixStorage>(), *pool.value(), kReaders);
    const std::string before = Bytes(kRegionBytes, 9);
    auto region = std::make_shared<WritableRegion>("/ckpt-test-region", before);
    auto restored = engine.Restore(path, Targets(region), false);
    INFO(restored.status().message());
    REQUIRE(restored.ok());
    CHECK(region->bytes() == Restored(shard, before));
    CHECK(region->writes() == static_cast<int>(ExpectedCopies(shard)));
    CHECK(pool.value()->used_bytes() == 0);
  }
}

namespace {

// The real file system, except that the second read at file offset `at` returns one bit
// flipped: a file whose bytes change between a two-pass restore's passes.
class ChangingStorage : public StorageWrapper {
 public:
  explicit ChangingStorage(std::uint64_t at) : StorageWrapper(std::make_shared<PosixStorage>()), at_(at) {}
  Result<std::size_t> ReadAt(int fd, void* buf, std::size_t len, std::uint64_t offset,
                             const std::string& what) override {
    auto got = StorageWrapper::ReadAt(fd, buf, len, offset, what);
    if (offset == at_ && ++reads_at_ == 2 && got.ok() && got.value() > 0) static_cast<char*>(buf)[0] ^= 1;
    return got;
  }

 private:
  const std::uint64_t at_;
  std::atomic<int> reads_at_{0};
};

}  // namespace

TEST_CASE("a shard whose bytes change between the two passes is refused before the changed chunk is copied",
          "[restore-engine]") {
  const TestShard shard = MakeShard();
  TempDir dir("rst");
  const std::string path = dir.path() + "/shard.safetensors";
  WriteFile(path, shard.file);
  // Chunk 2 of the data section holds the tail of "a" and the head of "b".
  const std::uint64_t changed = shard.info.data_start + 2 * kChunk;
  auto pool = HostPool::Create(2 * kChunk, kChunk);
  REQUIRE(pool.ok());
  FakeBackend backend;
  RestoreEngine engine(std::make_shared<ChangingStorage>(changed), *pool.value(), kReaders, &backend, 2);
  const std::string before = Bytes(kRegionBytes, 10);
  auto region = std::make_shared<FakeDeviceRegion>("cuda:fake", before);
  auto restored = engine.Restore(path, Targets(region), false);
  REQUIRE_FALSE(restored.ok());
  const std::string message = restored.status().message();
  INFO(message);
  CHECK(restored.status().code() == StatusCode::kIoError);  // not DATA_LOSS: no other tier is tried
  CHECK_THAT(message, Catch::Contains("changed between its verification and its copy"));
  CHECK_THAT(message, Catch::Contains("partly written"));
  // Chunks 0 and 1 (the head of "a", at the start of the region) were copied; nothing of
  // chunk 2 or later was.
  const std::string after = Restored(shard, before);
  CHECK(region->bytes().substr(0, 2 * kChunk) == after.substr(0, 2 * kChunk));
  CHECK(region->bytes().substr(2 * kChunk) == before.substr(2 * kChunk));
  CHECK(region->writes() == 0);
  CHECK(pool.value()->used_bytes() == 0);
}

namespace {

// Host memory that records the ranges a restore preallocated, and how many writes it had
// taken by then.
class PreallocatedRegion : public WritableRegion {
 public:
  using WritableRegion::WritableRegion;
  void Preallocate(std::uint64_t offset, std::uint64_t len) const override {
    std::lock_guard lock(mu_);
    ranges_.emplace_back(offset, len);
    writes_before_ += writes();
  }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges() const {
    std::lock_guard lock(mu_);
    return ranges_;
  }
  int writes_before() const {
    std::lock_guard lock(mu_);
    return writes_before_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges_;
  mutable int writes_before_ = 0;
};

}  // namespace

// A memory image into shm regions is written straight from the image: the pool's chunks,
// which snapshots may hold all of (backpressure), are not needed. Before, the restore
// waited for a free chunk.
TEST_CASE("a memory image restores into several host regions with every pool chunk held elsewhere",
          "[restore-engine]") {
  const TestShard shard = MakeShard();
  auto pool = HostPool::Create(2 * kChunk, kChunk);
  REQUIRE(pool.ok());
  auto held_a = pool.value()->TryAcquire();
  auto held_b = pool.value()->TryAcquire();
  REQUIRE((held_a && held_b));
  REQUIRE_FALSE(pool.value()->TryAcquire());
  RestoreEngine engine(std::make_shared<PosixStorage>(), *pool.value(), /*readers=*/4);
  // "a" and "b" in one region, "c" and "empty" in others.
  const std::string before_ab = Bytes(kRegionBytes, 11), before_c = Bytes(kRegionBytes, 12);
  auto ab = std::make_shared<PreallocatedRegion>("/ckpt-test-ab", before_ab);
  auto c = std::make_shared<PreallocatedRegion>("/ckpt-test-c", before_c);
  auto empty = std::make_shared<PreallocatedRegion>("/ckpt-test-empty", std::string(16, 'e'));
  std::vector<RestoreTarget> targets = Targets(ab);
  for (auto& t : targets) {
    if (t.item.name == "c") t.region = c;
    if (t.item.name == "empty") t.region = empty;
  }
  Image image(shard.file);
  auto restored = engine.RestoreFromImage(*image.image, targets);
  INFO(restored.status().message());
  REQUIRE(restored.ok());
  CHECK(restored->bytes_read == 0);
  CHECK(restored->tensor_bytes == 150 * kKiB + 7 + 90 * kKiB + 1 + 160 * kKiB + 5);
  REQUIRE(restored->blobs.size() == 1);
  CHECK(restored->blobs[0].second == shard.contents[2]);
  std::string want_ab = before_ab, want_c = before_c;
  want_ab.replace(0, shard.contents[0].size(), shard.contents[0]);
  want_ab.replace(150 * kKiB + 7, shard.contents[1].size(), shard.contents[1]);
  want_c.replace(300 * kKiB, shard.contents[4].size(), shard.contents[4]);
  CHECK(ab->bytes() == want_ab);
  CHECK(c->bytes() == want_c);
  CHECK(empty->bytes() == std::string(16, 'e'));
  // Pieces of at most a pool chunk: a 3, b 2, c 3; nothing for the empty tensor.
  CHECK(ab->writes() == 5);
  CHECK(c->writes() == 3);
  CHECK(empty->writes() == 0);
  // Each target's range was preallocated before any write.
  using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;
  auto sorted = [](Ranges r) {
    std::sort(r.begin(), r.end());
    return r;
  };
  CHECK(sorted(ab->ranges()) == Ranges{{0, 150 * kKiB + 7}, {150 * kKiB + 7, 90 * kKiB + 1}});
  CHECK(c->ranges() == Ranges{{300 * kKiB, 160 * kKiB + 5}});
  CHECK(ab->writes_before() + c->writes_before() == 0);
  pool.value()->Release(*held_a);
  pool.value()->Release(*held_b);
}

// Items are verified on several threads; the error names the shard's first bad item, and
// nothing is written, whichever thread found which.
TEST_CASE("a memory image with two corrupt items names the first and writes nothing", "[restore-engine]") {
  TestShard shard = MakeShard();
  std::string corrupt = shard.file;
  corrupt[shard.info.data_start + OffsetOf(shard, "b") + 5] ^= 0x01;
  corrupt[shard.info.data_start + OffsetOf(shard, "c") + 7] ^= 0x01;
  auto pool = HostPool::Create(4 * kChunk, kChunk);
  REQUIRE(pool.ok());
  RestoreEngine engine(std::make_shared<PosixStorage>(), *pool.value(), /*readers=*/4);
  const std::string before = Bytes(kRegionBytes, 13);
  auto region = std::make_shared<WritableRegion>("/ckpt-test-region", before);
  for (int round = 0; round < 20; ++round) {
    Image image(corrupt);
    auto restored = engine.RestoreFromImage(*image.image, Targets(region));
    REQUIRE_FALSE(restored.ok());
    INFO(restored.status().message());
    CHECK(restored.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(restored.status().message(), Catch::Contains("checksum mismatch in item 'b'"));
    CHECK_THAT(restored.status().message(), Catch::Contains("nothing was written to the registered regions"));
  }
  CHECK(region->bytes() == before);
  CHECK(region->writes() == 0);
}
