// Shared-memory regions and the descriptor table, read the way the daemon reads them:
// through pread on a descriptor of the object, never through a mapping.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/io/shm_importer.h"
#include "shm/descriptor_table.h"
#include "shm/shm_region.h"

using namespace ckpt;

namespace {

// A name no other test process uses.
std::string UniqueName(const std::string& tag) {
  static int serial = 0;
  return "/ckpt-shmtest-" + std::to_string(::getpid()) + "-" + tag + "-" + std::to_string(serial++);
}

std::string DevShmPath(const std::string& name) { return "/dev/shm" + name; }

bool ShmExists(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// The daemon's view of a table: a read-only descriptor and pread.
struct TableReader {
  explicit TableReader(const std::string& name) : fd(::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0)) {
    REQUIRE(fd.valid());
    struct stat st {};
    REQUIRE(::fstat(fd.get(), &st) == 0);
    size = static_cast<std::uint64_t>(st.st_size);
  }
  TableReadFn Fn() const {
    return [this](std::uint64_t off, void* dst, std::size_t len) -> Status {
      ssize_t r = ::pread(fd.get(), dst, len, static_cast<off_t>(off));
      if (r < 0) return IoError("pread table", errno);
      if (static_cast<std::size_t>(r) != len) return DataLoss("short read of table");
      return Status::Ok();
    };
  }
  Result<std::vector<TableItem>> Read(std::uint64_t* generation) const {
    return ReadDescriptorTable(Fn(), size, generation);
  }
  // The whole object, for tests that corrupt a copy.
  std::vector<char> Snapshot() const {
    std::vector<char> bytes(size);
    REQUIRE(::pread(fd.get(), bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
    return bytes;
  }
  UniqueFd fd;
  std::uint64_t size = 0;
};

// A reader over bytes in memory.
TableReadFn FromBytes(const std::vector<char>& bytes) {
  return [&bytes](std::uint64_t off, void* dst, std::size_t len) -> Status {
    if (off + len > bytes.size()) return DataLoss("read past the end of the table");
    std::memcpy(dst, bytes.data() + off, len);
    return Status::Ok();
  };
}

template <typename T>
void Poke(std::vector<char>& bytes, std::size_t at, T value) {
  REQUIRE(at + sizeof value <= bytes.size());
  std::memcpy(bytes.data() + at, &value, sizeof value);
}

TableItem Item(std::string name, DType dtype, std::vector<std::int64_t> shape, std::string region,
               std::uint64_t offset, std::uint64_t length, std::uint64_t generation = 1) {
  TableItem it;
  it.name = std::move(name);
  it.dtype = dtype;
  it.shape = std::move(shape);
  it.region = std::move(region);
  it.offset = offset;
  it.length = length;
  it.generation = generation;
  return it;
}

void CheckSame(const std::vector<TableItem>& got, const std::vector<TableItem>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("item " << i);
    CHECK(got[i].name == want[i].name);
    CHECK(got[i].dtype == want[i].dtype);
    CHECK(got[i].shape == want[i].shape);
    CHECK(got[i].region == want[i].region);
    CHECK(got[i].offset == want[i].offset);
    CHECK(got[i].length == want[i].length);
    CHECK(got[i].generation == want[i].generation);
  }
}

constexpr std::size_t kSlot0 = sizeof(TableHeader);

}  // namespace

TEST_CASE("a region is a 0600 object in /dev/shm, unlinked when destroyed", "[shm]") {
  std::string name;
  {
    auto region = ShmRegion::Create("", 10000);
    REQUIRE(region.ok());
    name = region->name();
    CHECK(CheckShmName(name).empty());
    CHECK(region->size() == 10000);
    REQUIRE(region->data() != nullptr);
    std::memset(region->data(), 0x5a, region->size());

    struct stat st {};
    REQUIRE(::stat(DevShmPath(name).c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(st.st_uid == ::getuid());
    CHECK(st.st_size == 10000);

    // The daemon's path: pread on its own descriptor sees what the trainer wrote.
    TableReader reader(name);
    char byte = 0;
    REQUIRE(::pread(reader.fd.get(), &byte, 1, 9999) == 1);
    CHECK(byte == 0x5a);
  }
  CHECK_FALSE(ShmExists(name));
  struct stat st {};
  CHECK(::stat(DevShmPath(name).c_str(), &st) != 0);
}

TEST_CASE("regions created without a name get distinct names", "[shm]") {
  auto a = ShmRegion::Create("", 4096);
  auto b = ShmRegion::Create("", 4096);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->name() != b->name());
  CHECK(a->data() != b->data());
}

TEST_CASE("creating a region over a stale object of the same name replaces it", "[shm]") {
  std::string name = UniqueName("stale");
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 4096) == 0);
  REQUIRE(::pwrite(fd, "old!", 4, 0) == 4);
  struct stat old_st {};
  REQUIRE(::fstat(fd, &old_st) == 0);
  ::close(fd);

  {
    auto region = ShmRegion::Create(name, 8192);
    REQUIRE(region.ok());
    CHECK(region->name() == name);
    CHECK(std::memcmp(region->data(), "\0\0\0\0", 4) == 0);  // fresh, not reused
    struct stat st {};
    REQUIRE(::stat(DevShmPath(name).c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(st.st_size == 8192);
  }
  CHECK_FALSE(ShmExists(name));
}

TEST_CASE("Create refuses bad names and empty regions", "[shm]") {
  CHECK(ShmRegion::Create("no-slash", 4096).status().code() == StatusCode::kInvalidArgument);
  CHECK(ShmRegion::Create("/a/b", 4096).status().code() == StatusCode::kInvalidArgument);
  CHECK(ShmRegion::Create("/..", 4096).status().code() == StatusCode::kInvalidArgument);
  std::string name = UniqueName("empty");
  CHECK(ShmRegion::Create(name, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(ShmExists(name));
}

TEST_CASE("Resize changes the size, keeps the common bytes and bumps the generation", "[shm]") {
  auto created = ShmRegion::Create("", 4096);
  REQUIRE(created.ok());
  ShmRegion region = std::move(created).value();
  CHECK(region.generation() == 0);
  std::memcpy(region.data(), "keep", 4);

  REQUIRE(region.Resize(3 * 4096 + 5).ok());
  CHECK(region.generation() == 1);
  CHECK(region.size() == 3 * 4096 + 5);
  CHECK(std::memcmp(region.data(), "keep", 4) == 0);
  static_cast<char*>(region.data())[3 * 4096 + 4] = 'z';  // the new end is mapped
  struct stat st {};
  REQUIRE(::fstat(region.fd(), &st) == 0);
  CHECK(st.st_size == 3 * 4096 + 5);

  REQUIRE(region.Resize(100).ok());
  CHECK(region.generation() == 2);
  CHECK(region.size() == 100);
  CHECK(std::memcmp(region.data(), "keep", 4) == 0);
  REQUIRE(::fstat(region.fd(), &st) == 0);
  CHECK(st.st_size == 100);
}

TEST_CASE("a moved region keeps its object and the moved-from one unlinks nothing", "[shm]") {
  auto created = ShmRegion::Create("", 4096);
  REQUIRE(created.ok());
  std::string name = created->name();
  std::optional<ShmRegion> holder;
  {
    ShmRegion first = std::move(created).value();
    REQUIRE(first.Resize(8192).ok());
    holder.emplace(std::move(first));
    CHECK(first.name().empty());
    CHECK(first.data() == nullptr);
  }
  CHECK(ShmExists(name));
  CHECK(holder->name() == name);
  CHECK(holder->size() == 8192);
  CHECK(holder->generation() == 1);

  auto other = ShmRegion::Create("", 4096);
  REQUIRE(other.ok());
  std::string other_name = other->name();
  *holder = std::move(other).value();  // the overwritten region's object goes away
  CHECK_FALSE(ShmExists(name));
  CHECK(ShmExists(other_name));
  holder.reset();
  CHECK_FALSE(ShmExists(other_name));
}

TEST_CASE("CheckShmName accepts one-component names and rejects the rest", "[shm]") {
  for (const std::string& ok : std::vector<std::string>{"/a", "/ckpt-1000-42-0", "/x.y_z",
                                                        std::string("/") + std::string(199, 'n')}) {
    INFO(ok);
    CHECK(CheckShmName(ok).empty());
  }
  for (const std::string& bad : std::vector<std::string>{
           std::string(), std::string("/"), std::string("a"), std::string("noslash"), std::string("/a/b"),
           std::string("//"), std::string("/."), std::string("/.."), std::string("/with space"),
           std::string("/tab\t"), std::string("/nul\0x", 6), std::string("/del\x7f"),
           std::string("/caf\xc3\xa9"), std::string("/") + std::string(200, 'n')}) {
    INFO(bad.size() << " bytes");
    CHECK_FALSE(CheckShmName(bad).empty());
  }
}

TEST_CASE("DescriptorTable::Create validates the capacity", "[table]") {
  CHECK(DescriptorTable::Create("", 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(DescriptorTable::Create("", kMaxTableItems + 1).status().code() == StatusCode::kInvalidArgument);
  auto table = DescriptorTable::Create("", 3);
  REQUIRE(table.ok());
  CHECK(table->capacity() == 3);
  CHECK(table->generation() % 2 == 0);
  TableReader reader(table->name());
  CHECK(reader.size >= sizeof(TableHeader) + 3 * sizeof(ItemDescriptor));
  std::uint64_t gen = 1;
  auto items = reader.Read(&gen);
  REQUIRE(items.ok());
  CHECK(items->empty());
  CHECK(gen == table->generation());
}

TEST_CASE("a written table reads back through pread, generation +2 per write", "[table]") {
  auto created = DescriptorTable::Create("", 4);
  REQUIRE(created.ok());
  DescriptorTable table = std::move(created).value();
  TableReader reader(table.name());
  std::uint64_t g0 = table.generation();

  std::vector<TableItem> first = {
      Item("layers.0.attn.weight", DType::kBF16, {4096, 4096}, "/ckpt-1000-1-0", 0, 4096ull * 4096 * 2, 3),
      Item("layers.0.attn.bias", DType::kF32, {4096}, "/ckpt-1000-1-0", 4096ull * 4096 * 2, 4096 * 4, 3),
      Item("step", DType::kI64, {}, "/ckpt-1000-1-1", 0, 8, 1),
      Item("eight.dims", DType::kU8, {1, 2, 1, 2, 1, 2, 1, 2}, std::string(kMaxRegionNameBytes, 'r'), 64, 16,
           0),
  };
  REQUIRE(table.Write(first).ok());
  CHECK(table.generation() == g0 + 2);
  std::uint64_t gen = 0;
  auto items = reader.Read(&gen);
  REQUIRE(items.ok());
  CHECK(gen == g0 + 2);
  CheckSame(items.value(), first);
  auto only_gen = ReadTableGeneration(reader.Fn());
  REQUIRE(only_gen.ok());
  CHECK(only_gen.value() == g0 + 2);

  // Fewer items: the stale slots behind item_count are not returned.
  std::vector<TableItem> second = {Item(std::string(kMaxNameBytes, 'n'), DType::kF8E5M2, {3}, "/r", 5, 3, 9)};
  REQUIRE(table.Write(second).ok());
  CHECK(table.generation() == g0 + 4);
  items = reader.Read(&gen);
  REQUIRE(items.ok());
  CHECK(gen == g0 + 4);
  CheckSame(items.value(), second);

  REQUIRE(table.Write({}).ok());
  CHECK(table.generation() == g0 + 6);
  items = reader.Read(&gen);
  REQUIRE(items.ok());
  CHECK(items->empty());
}

TEST_CASE("Write refuses what does not fit the layout and leaves the table as it was", "[table]") {
  auto created = DescriptorTable::Create("", 2);
  REQUIRE(created.ok());
  DescriptorTable table = std::move(created).value();
  std::vector<TableItem> good = {Item("w", DType::kF32, {2}, "/r", 0, 8)};
  REQUIRE(table.Write(good).ok());
  std::uint64_t g = table.generation();

  std::vector<TableItem> bad;
  SECTION("more items than the capacity") { bad = {good[0], good[0], good[0]}; }
  SECTION("name too long") { bad = {Item(std::string(kMaxNameBytes + 1, 'n'), DType::kU8, {1}, "/r", 0, 1)}; }
  SECTION("region name too long") {
    bad = {Item("w", DType::kU8, {1}, std::string(kMaxRegionNameBytes + 1, 'r'), 0, 1)};
  }
  SECTION("too many dimensions") { bad = {Item("w", DType::kU8, {1, 1, 1, 1, 1, 1, 1, 1, 1}, "/r", 0, 1)}; }
  CHECK(table.Write(bad).code() == StatusCode::kInvalidArgument);
  CHECK(table.generation() == g);
  TableReader reader(table.name());
  std::uint64_t gen = 0;
  auto items = reader.Read(&gen);
  REQUIRE(items.ok());
  CHECK(gen == g);
  CheckSame(items.value(), good);
}

TEST_CASE("a malformed table is data loss", "[table]") {
  auto created = DescriptorTable::Create("", 2);
  REQUIRE(created.ok());
  DescriptorTable table = std::move(created).value();
  REQUIRE(
      table.Write({Item("a", DType::kF32, {2}, "/r", 0, 8), Item("b", DType::kU8, {3}, "/r", 8, 3)}).ok());
  std::vector<char> bytes = TableReader(table.name()).Snapshot();
  std::uint64_t gen = 0;
  REQUIRE(ReadDescriptorTable(FromBytes(bytes), bytes.size(), &gen).ok());  // the untouched copy is fine

  std::uint64_t size = bytes.size();
  SECTION("bad magic") { bytes[3] = 'X'; }
  SECTION("item_count larger than capacity") {
    Poke<std::uint32_t>(bytes, offsetof(TableHeader, item_count), 3);
  }
  SECTION("capacity larger than the object") {
    Poke<std::uint32_t>(bytes, offsetof(TableHeader, capacity), 3);
  }
  SECTION("capacity over the limit") {
    Poke<std::uint32_t>(bytes, offsetof(TableHeader, capacity), kMaxTableItems + 1);
  }
  SECTION("object smaller than the header") { size = sizeof(TableHeader) - 1; }
  SECTION("object smaller than its slots") { size = bytes.size() - 1; }
  SECTION("slot with dtype 0") { Poke<std::uint8_t>(bytes, kSlot0 + offsetof(ItemDescriptor, dtype), 0); }
  SECTION("slot with an unknown dtype") {
    Poke<std::uint8_t>(bytes, kSlot0 + sizeof(ItemDescriptor) + offsetof(ItemDescriptor, dtype), 200);
  }
  SECTION("slot with too many dimensions") {
    Poke<std::uint8_t>(bytes, kSlot0 + offsetof(ItemDescriptor, ndim), kMaxDims + 1);
  }
  SECTION("slot with a name longer than its field") {
    Poke<std::uint16_t>(bytes, kSlot0 + offsetof(ItemDescriptor, name_len), kMaxNameBytes + 1);
  }
  SECTION("slot with a region name longer than its field") {
    Poke<std::uint16_t>(bytes, kSlot0 + offsetof(ItemDescriptor, region_len), kMaxRegionNameBytes + 1);
  }
  SECTION("writer stuck mid-update (odd generation)") {
    Poke<std::uint64_t>(bytes, offsetof(TableHeader, generation), 7);
  }
  auto items = ReadDescriptorTable(FromBytes(bytes), size, &gen);
  INFO(items.status().message());
  CHECK(items.status().code() == StatusCode::kDataLoss);
}

TEST_CASE("a table whose generation changes on every read is refused, not returned torn", "[table]") {
  auto created = DescriptorTable::Create("", 1);
  REQUIRE(created.ok());
  REQUIRE(created->Write({Item("a", DType::kF32, {2}, "/r", 0, 8)}).ok());
  std::vector<char> bytes = TableReader(created->name()).Snapshot();
  std::uint64_t g = 0;
  std::memcpy(&g, bytes.data() + offsetof(TableHeader, generation), sizeof g);
  int header_reads = 0;
  TableReadFn moving = [&](std::uint64_t off, void* dst, std::size_t len) -> Status {
    if (off == 0) {
      // Every header read sees a newer even generation: a writer that never stops.
      g += 2;
      Poke<std::uint64_t>(bytes, offsetof(TableHeader, generation), g);
      ++header_reads;
    }
    std::memcpy(dst, bytes.data() + off, len);
    return Status::Ok();
  };
  std::uint64_t gen = 0;
  auto items = ReadDescriptorTable(moving, bytes.size(), &gen);
  CHECK(items.status().code() == StatusCode::kDataLoss);
  CHECK_THAT(items.status().message(), Catch::Contains("kept changing"));
  CHECK(header_reads > 1);
}

TEST_CASE("a failing read callback is reported as its own error", "[table]") {
  TableReadFn failing = [](std::uint64_t, void*, std::size_t) { return IoError("pread table", EIO); };
  std::uint64_t gen = 0;
  auto items = ReadDescriptorTable(failing, 1 << 20, &gen);
  CHECK(items.status().code() == StatusCode::kIoError);
  CHECK(ReadTableGeneration(failing).status().code() == StatusCode::kIoError);
}

TEST_CASE("a reader racing a writer sees whole tables only", "[table]") {
  auto created = DescriptorTable::Create("", 6);
  REQUIRE(created.ok());
  DescriptorTable table = std::move(created).value();
  TableReader reader(table.name());

  // Each write stamps every item's offset with the generation the write will produce, and
  // alternates between 3 and 6 items with different names: a torn read shows up as an
  // offset from another generation or names from the other set.
  std::atomic<bool> done{false};
  std::atomic<int> reads{0};
  std::thread writer([&] {
    // Keeps writing until the reader has had a fair number of tries at it.
    for (int i = 0; i < 3000 || reads.load() < 200; ++i) {
      std::uint64_t next = table.generation() + 2;
      std::vector<TableItem> items;
      std::size_t n = i % 2 == 0 ? 3 : 6;
      for (std::size_t k = 0; k < n; ++k) {
        items.push_back(Item((n == 3 ? "three." : "six.") + std::to_string(k), DType::kU8,
                             {static_cast<std::int64_t>(n)}, "/r", next, n, next));
      }
      if (!table.Write(items).ok()) break;
    }
    done.store(true);
  });
  int whole = 0;
  int torn = 0;
  int other_errors = 0;
  std::uint64_t last = 0;
  bool went_back = false;
  while (!done.load()) {
    std::uint64_t gen = 0;
    auto items = reader.Read(&gen);
    reads.fetch_add(1);
    if (!items.ok()) {
      if (items.status().message().find("kept changing") == std::string::npos) ++other_errors;
      continue;
    }
    ++whole;
    if (gen < last) went_back = true;
    last = gen;
    if (gen % 2 != 0) ++torn;
    for (std::size_t k = 0; k < items->size(); ++k) {
      const TableItem& it = items.value()[k];
      std::string want = (items->size() == 3 ? "three." : "six.") + std::to_string(k);
      if (it.offset != gen || it.generation != gen || it.name != want ||
          it.shape != std::vector<std::int64_t>{static_cast<std::int64_t>(items->size())}) {
        ++torn;
      }
    }
  }
  writer.join();
  CHECK(torn == 0);
  CHECK(other_errors == 0);
  CHECK_FALSE(went_back);
  std::uint64_t gen = 0;
  auto final_items = reader.Read(&gen);
  REQUIRE(final_items.ok());
  CHECK(gen == table.generation());
  CHECK(final_items->size() % 3 == 0);
  INFO(whole << " whole tables read");
  SUCCEED();
}

// Issue 12, defect 2: the reaper removes a dead trainer's names with UnlinkShmIfInode; a FIFO
// put in a region's place made that open block for ever, wedging the reaper and SIGTERM.
TEST_CASE("removing a name that a FIFO now holds neither blocks nor removes the FIFO", "[shm][hardening]") {
  const std::string name = "/ckpt-test-fifo-" + std::to_string(::getpid());
  const std::string path = "/dev/shm" + name;
  ::unlink(path.c_str());
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  std::atomic<bool> returned{false};
  std::thread t([&] {
    UnlinkShmIfInode(name, /*inode=*/1);
    returned = true;
  });
  for (int i = 0; i < 2000 && !returned; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!returned) {
    // Unblock the reader so that the test ends (and fails) rather than hangs.
    int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
  }
  t.join();
  CHECK(returned);
  struct stat st {};
  CHECK(::lstat(path.c_str(), &st) == 0);  // not ours: left alone
  ::unlink(path.c_str());
}

// The one mapping the daemon keeps of a trainer's object (its release words, which only the
// daemon's GPU streams write): checked as every import is.
TEST_CASE("the daemon maps a trainer's release words only if the trainer's uid owns them") {
  auto region = ShmRegion::Create(UniqueName("words"), 4096);
  REQUIRE(region.ok());
  auto mapped = MapShmObject(region->name(), ::getuid(), 4096);
  REQUIRE(mapped.ok());
  CHECK(mapped.value()->size() == 4096);
  // The same page: what the daemon's side writes, the trainer reads.
  static_cast<volatile std::uint32_t*>(mapped.value()->data())[3] = 77;
  CHECK(static_cast<volatile std::uint32_t*>(region->data())[3] == 77);

  auto other = MapShmObject(region->name(), ::getuid() + 1, 4096);
  REQUIRE_FALSE(other.ok());
  CHECK(other.status().code() == StatusCode::kPermissionDenied);
  CHECK(other.status().message().find("belongs to uid " + std::to_string(::getuid())) != std::string::npos);
  auto small = MapShmObject(region->name(), ::getuid(), 8192);
  REQUIRE_FALSE(small.ok());
  CHECK(small.status().code() == StatusCode::kInvalidArgument);
  CHECK(MapShmObject("/ckpt-no-such-words-object", ::getuid(), 4096).status().code() ==
        StatusCode::kNotFound);
  CHECK(MapShmObject("bad/name", ::getuid(), 4096).status().code() == StatusCode::kInvalidArgument);
}

// A restart's wait faults a fresh region's pages in before the restore writes them: the
// trainer's bytes (on pages it wrote, and on a page it wrote part of), the object's size and
// everything outside the range stay as they were; the range's pages are then in memory.
TEST_CASE("Prefault backs a range of a trainer's object with pages and changes no byte", "[shm]") {
  constexpr std::size_t kPage = 4096, kBytes = 64 * kPage;
  auto region = ShmRegion::Create(UniqueName("prefault"), kBytes);
  REQUIRE(region.ok());
  auto* bytes = static_cast<unsigned char*>(region->data());
  for (std::size_t i = 0; i < kPage; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  for (std::size_t i = 0; i < 100; ++i) bytes[30 * kPage + 50 + i] = static_cast<unsigned char>(i + 3);
  auto imported = ShmImporter().Import(region->name(), ::getuid(), kBytes);
  REQUIRE(imported.ok());
  struct stat before {};
  REQUIRE(::fstat(region->fd(), &before) == 0);
  CHECK(before.st_blocks * 512 == static_cast<blkcnt_t>(2 * kPage));

  // An offset inside a page, a range past the end (clamped: the object does not grow),
  // and one wholly past it.
  imported.value()->Prefault(100, 40 * kPage - 100);
  imported.value()->Prefault(60 * kPage, 100 * kPage);
  imported.value()->Prefault(kBytes + kPage, kPage);
  struct stat after {};
  REQUIRE(::fstat(region->fd(), &after) == 0);
  CHECK(after.st_size == static_cast<off_t>(kBytes));
  CHECK(after.st_blocks * 512 == static_cast<blkcnt_t>(44 * kPage));
  // Faulted in, not only allocated: the pages read as data, where Preallocate's allocated
  // pages are holes until written. Checked before this test's own reads below, which fault
  // the pages in through its mapping.
  CHECK(::lseek(region->fd(), 5 * kPage, SEEK_DATA) == static_cast<off_t>(5 * kPage));
  for (std::size_t i = 0; i < kPage; ++i) REQUIRE(bytes[i] == static_cast<unsigned char>(i * 7 + 1));
  for (std::size_t i = 0; i < 100; ++i) REQUIRE(bytes[30 * kPage + 50 + i] == static_cast<unsigned char>(i + 3));
  for (std::size_t i = kPage; i < kBytes; ++i) {
    if (i >= 30 * kPage + 50 && i < 30 * kPage + 150) continue;
    REQUIRE(bytes[i] == 0);
  }
  const std::string text = "restored";
  REQUIRE(imported.value()->WriteAt(20 * kPage, text.data(), text.size()).ok());
  CHECK(std::memcmp(bytes + 20 * kPage, text.data(), text.size()) == 0);
}

// A restore preallocates a fresh region's pages before it writes them: the trainer's
// bytes, the object's size and everything outside the range stay as they were.
TEST_CASE("Preallocate backs a range of a trainer's object with pages and changes no byte", "[shm]") {
  constexpr std::size_t kPage = 4096, kBytes = 64 * kPage;
  auto region = ShmRegion::Create(UniqueName("prealloc"), kBytes);
  REQUIRE(region.ok());
  auto* bytes = static_cast<unsigned char*>(region->data());
  for (std::size_t i = 0; i < kPage; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  auto imported = ShmImporter().Import(region->name(), ::getuid(), kBytes);
  REQUIRE(imported.ok());
  struct stat before {};
  REQUIRE(::fstat(region->fd(), &before) == 0);
  // 512-byte blocks: the one page the trainer touched.
  CHECK(before.st_blocks * 512 == static_cast<blkcnt_t>(kPage));

  // Past the end too: clamped to the object, which does not grow.
  imported.value()->Preallocate(0, 40 * kPage);
  imported.value()->Preallocate(60 * kPage, 100 * kPage);
  imported.value()->Preallocate(kBytes + kPage, kPage);
  struct stat after {};
  REQUIRE(::fstat(region->fd(), &after) == 0);
  CHECK(after.st_size == static_cast<off_t>(kBytes));
  CHECK(after.st_blocks * 512 == static_cast<blkcnt_t>(44 * kPage));
  CHECK(::lseek(region->fd(), 5 * kPage, SEEK_DATA) != static_cast<off_t>(5 * kPage));
  for (std::size_t i = 0; i < kPage; ++i) REQUIRE(bytes[i] == static_cast<unsigned char>(i * 7 + 1));
  for (std::size_t i = kPage; i < kBytes; ++i) REQUIRE(bytes[i] == 0);
  // The pages it allocated take writes as any other.
  const std::string text = "restored";
  REQUIRE(imported.value()->WriteAt(20 * kPage, text.data(), text.size()).ok());
  CHECK(std::memcmp(bytes + 20 * kPage, text.data(), text.size()) == 0);
}
