// The descriptor table: the list of a trainer's tensor items, kept in shared memory so
// that per-iteration calls carry only a version number.
//
// Layout (all little-endian, fixed size):
//   TableHeader, then `capacity` ItemDescriptor slots, of which `item_count` are used.
// The writer (the client) updates the table like a seqlock: it makes `generation` odd,
// rewrites the items, then makes it even again. The reader (the daemon) reads the table
// with pread and accepts it only if it saw the same even generation before and after; it
// re-reads the table whenever the generation differs from the one it validated. Nothing
// here is a lock, so a trainer that dies mid-update cannot block the daemon.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "format/dtype.h"
#include "shm/shm_region.h"

namespace ckpt {

inline constexpr char kTableMagic[8] = {'C', 'K', 'P', 'T', 'T', 'B', 'L', '1'};
inline constexpr std::uint32_t kMaxDims = 8;
inline constexpr std::uint32_t kMaxNameBytes = 256;
inline constexpr std::uint32_t kMaxRegionNameBytes = 224;
// Bounds the memory one registration costs the daemon (about 600 bytes an item).
inline constexpr std::uint32_t kMaxTableItems = 1u << 17;

struct TableHeader {
  char magic[8];
  std::uint32_t capacity;
  std::uint32_t item_count;
  std::uint64_t generation;  // even when stable, odd while the writer updates the table
};

struct ItemDescriptor {
  std::uint64_t offset;      // byte offset of the item in its region
  std::uint64_t length;      // bytes
  std::uint64_t generation;  // the region's generation when the item was registered
  std::int64_t shape[kMaxDims];
  std::uint16_t name_len;
  std::uint16_t region_len;
  std::uint8_t dtype;  // DType value
  std::uint8_t ndim;
  std::uint8_t reserved[2];
  char name[kMaxNameBytes];          // name_len bytes, not NUL-terminated
  char region[kMaxRegionNameBytes];  // region_len bytes: shm name, or "cuda:..." (cuda/region_name.h)
};

static_assert(sizeof(TableHeader) == 24);
static_assert(sizeof(ItemDescriptor) % 8 == 0);

// One item as the daemon understands it after reading the table.
struct TableItem {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;
  std::string region;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint64_t generation = 0;
};

// Writer side, owned by the client.
class DescriptorTable {
 public:
  // Creates a table region with room for `capacity` items.
  static Result<DescriptorTable> Create(std::string name, std::uint32_t capacity);

  const std::string& name() const { return region_.name(); }
  std::uint32_t capacity() const;
  // Generation of the current contents (even).
  std::uint64_t generation() const;
  // Replaces the contents with `items`. Checks only what the layout needs (counts and field
  // sizes); the daemon validates meaning.
  Status Write(const std::vector<TableItem>& items);

 private:
  TableHeader* header() const { return static_cast<TableHeader*>(region_.data()); }
  ShmRegion region_;
};

// Reader side. `read` copies bytes of the table object (the daemon passes its pread on the
// shm descriptor), `size` is the object's size. Fails with DataLoss if the table is
// malformed or kept changing while read. `generation` receives the generation.
using TableReadFn = std::function<Status(std::uint64_t offset, void* dst, std::size_t len)>;
Result<std::vector<TableItem>> ReadDescriptorTable(const TableReadFn& read, std::uint64_t size,
                                                   std::uint64_t* generation);
// Reads only the current generation of the table.
Result<std::uint64_t> ReadTableGeneration(const TableReadFn& read);

}  // namespace ckpt
