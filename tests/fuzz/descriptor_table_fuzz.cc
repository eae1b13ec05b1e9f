// Fuzz target: the daemon's reader of a trainer's descriptor table (shm/descriptor_table.h).
// The input is the table object's bytes, read through a callback as the daemon's pread does
// (a read past the end is an error, as a short pread is for the daemon).
//
// Invariants checked on every table that reads:
//   - its generation is even and every item is within the layout's limits;
//   - the client's writer (DescriptorTable::Write), given the items read, makes a table that
//     reads back as the same items.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "fuzz_check.h"
#include "shm/descriptor_table.h"

namespace {

constexpr std::uint32_t kRoundTripCapacity = 256;

bool Same(const ckpt::TableItem& a, const ckpt::TableItem& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.region == b.region &&
         a.offset == b.offset && a.length == b.length && a.generation == b.generation;
}

// A table of the client's writer, read back through its shm object as the daemon would.
struct WrittenTable {
  ckpt::DescriptorTable table;
  int fd = -1;
  std::uint64_t size = 0;
  WrittenTable() {
    auto t = ckpt::DescriptorTable::Create("", kRoundTripCapacity);
    if (!t.ok()) std::abort();
    table = std::move(t).value();
    fd = ::shm_open(table.name().c_str(), O_RDONLY | O_CLOEXEC, 0);
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0) std::abort();
    size = static_cast<std::uint64_t>(st.st_size);
  }
  ~WrittenTable() { ::close(fd); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto read = [&](std::uint64_t offset, void* dst, std::size_t len) -> ckpt::Status {
    if (offset > size || len > size - offset) return ckpt::DataLoss("short read of the table");
    if (len > 0) std::memcpy(dst, data + offset, len);
    return ckpt::Status::Ok();
  };
  std::uint64_t generation = 1;
  auto items = ckpt::ReadDescriptorTable(read, size, &generation);
  if (!items.ok()) return 0;
  FUZZ_CHECK(generation % 2 == 0, "a table is accepted only at an even generation");
  for (const auto& it : items.value()) {
    FUZZ_CHECK(it.name.size() <= ckpt::kMaxNameBytes, "name length");
    FUZZ_CHECK(it.region.size() <= ckpt::kMaxRegionNameBytes, "region name length");
    FUZZ_CHECK(it.shape.size() <= ckpt::kMaxDims, "dimensions");
    FUZZ_CHECK(ckpt::IsValidDType(static_cast<std::uint8_t>(it.dtype)), "dtype");
  }
  if (items->size() > kRoundTripCapacity) return 0;
  static WrittenTable written;
  ckpt::Status w = written.table.Write(items.value());
  FUZZ_CHECK(w.ok(), w.message().c_str());
  auto pread_table = [&](std::uint64_t offset, void* dst, std::size_t len) -> ckpt::Status {
    ssize_t r = ::pread(written.fd, dst, len, static_cast<off_t>(offset));
    return r == static_cast<ssize_t>(len) ? ckpt::Status::Ok() : ckpt::DataLoss("short read");
  };
  std::uint64_t again_generation = 1;
  auto again = ckpt::ReadDescriptorTable(pread_table, written.size, &again_generation);
  FUZZ_CHECK(again.ok(), again.status().message().c_str());
  FUZZ_CHECK(again_generation == written.table.generation(), "generation read back");
  FUZZ_CHECK(again->size() == items->size(), "item count survives a write");
  for (std::size_t i = 0; i < items->size(); ++i) {
    FUZZ_CHECK(Same(again.value()[i], items.value()[i]), "items survive a write");
  }
  return 0;
}
