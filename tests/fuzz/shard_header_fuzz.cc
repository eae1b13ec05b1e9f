// Fuzz target: the shard reader (format/shard_format.h) on a whole shard file, the way the
// daemon, ckptctl and the Python binding read one: ReadShardHeader, then VerifyShard.
//
// Invariants checked on every header that parses:
//   - the items tile the data section exactly, inside the file, and each one's shape and
//     dtype give its length; the rank is below the world size;
//   - the header, planned and rendered again by the writer (ShardLayout), parses back to the
//     same metadata and items, layouts, block checksums and for_rank included (what one
//     reader accepts, the writer can say), and in the same format version;
//   - VerifyShard passes exactly when every item's bytes have its checksum.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "format/checksum.h"
#include "format/shard_format.h"
#include "fuzz_check.h"

namespace {

// The shard is a real file, rewritten for each input: the reader opens it by path. It lies
// in memory (/dev/shm) where there is one: ext4 flushes a file truncated and rewritten on
// every close, which made the fuzzer wait on the disk.
struct ShardFile {
  std::string dir;
  std::string path;
  int fd = -1;
  ShardFile() {
    const char* tmp = std::getenv("TMPDIR");
    std::string base = tmp && *tmp ? tmp : ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string templ = base + "/ckpt-fuzz-shard.XXXXXX";
    if (!::mkdtemp(templ.data())) std::abort();
    dir = templ;
    path = dir + "/rank-00000.safetensors";
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) std::abort();
  }
  ~ShardFile() {
    ::close(fd);
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  }
  void Set(const std::uint8_t* data, std::size_t size) {
    if (::ftruncate(fd, 0) != 0) std::abort();
    std::size_t done = 0;
    while (done < size) {
      ssize_t w = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
      if (w <= 0) std::abort();
      done += static_cast<std::size_t>(w);
    }
  }
};

bool SameItems(const ckpt::ShardItem& a, const ckpt::ShardItem& b) {
  return a.name == b.name && a.kind == b.kind && a.dtype == b.dtype && a.shape == b.shape &&
         a.length == b.length && a.offset == b.offset && a.checksum == b.checksum && a.layout == b.layout &&
         a.blocks.block_bytes == b.blocks.block_bytes && a.blocks.sums == b.blocks.sums && a.for_rank == b.for_rank;
}

void CheckParsed(const ckpt::ShardInfo& info, std::size_t size) {
  FUZZ_CHECK(info.file_bytes == size, "file size as read");
  FUZZ_CHECK(info.data_start >= 8 && info.data_start <= info.file_bytes, "data section inside the file");
  FUZZ_CHECK(info.meta.rank < info.meta.world_size, "rank of the world");
  const std::uint64_t data_bytes = info.file_bytes - info.data_start;
  std::uint64_t expect = 0;
  for (const auto& item : info.items) {
    FUZZ_CHECK(item.offset == expect, "items tile the data section in file order");
    FUZZ_CHECK(item.length <= data_bytes && item.offset <= data_bytes - item.length, "item inside the file");
    FUZZ_CHECK(ckpt::CheckItemShape(item).ok(), "shape and dtype give the length");
    expect += item.length;
  }
  FUZZ_CHECK(expect == data_bytes, "items cover the data section");

  auto layout = ckpt::ShardLayout::Plan(info.meta, info.items);
  FUZZ_CHECK(layout.ok(), layout.status().message().c_str());
  std::string header = layout->RenderHeader();
  auto again = ckpt::ParseShardHeader(std::string_view(header).substr(8), layout->file_bytes());
  FUZZ_CHECK(again.ok(), again.status().message().c_str());
  const ckpt::ShardMeta& m = again->meta;
  FUZZ_CHECK(m.job == info.meta.job && m.version == info.meta.version && m.rank == info.meta.rank &&
                 m.world_size == info.meta.world_size && m.session == info.meta.session,
             "metadata survives a render");
  FUZZ_CHECK(again->items.size() == info.items.size(), "item count survives a render");
  FUZZ_CHECK(info.format_version == "1" || again->format_version == info.format_version ||
                 (info.format_version == "3" && again->format_version == "2"),
             "format version survives a render (3 without its keys renders as 2)");
  for (std::size_t i = 0; i < info.items.size(); ++i) {
    FUZZ_CHECK(SameItems(again->items[i], info.items[i]), "items survive a render");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static ShardFile file;
  file.Set(data, size);
  auto info = ckpt::ReadShardHeader(file.path);
  if (!info.ok()) return 0;
  CheckParsed(info.value(), size);
  bool sums_match = true;
  for (const auto& item : info->items) {
    sums_match =
        sums_match && ckpt::Checksum::Of(data + info->data_start + item.offset, item.length) == item.checksum;
  }
  ckpt::Status verified = ckpt::VerifyShard(file.path);
  FUZZ_CHECK(verified.ok() == sums_match, verified.message().c_str());
  return 0;
}
