// Writes seeds made by the project's own writers into DIR/<target>/: shard files rendered by
// ShardLayout (the daemon's shard writer), descriptor tables written by DescriptorTable (the
// client's writer), and `latest` and COMMITTED as the catalog renders them.
//
//   ckpt-fuzz-seeds DIR
//
// The committed corpora (tests/fuzz/corpus/) began as this output; the test
// "fuzz_replay: fresh seeds" replays a new run of it, so a change to a writer that its reader
// no longer accepts fails there even before anyone refreshes the corpora.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "format/checksum.h"
#include "format/markers.h"
#include "format/shard_format.h"
#include "shm/descriptor_table.h"

namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

ckpt::ShardItem Item(std::string name, ckpt::ItemKind kind, ckpt::DType dtype,
                     std::vector<std::int64_t> shape) {
  ckpt::ShardItem it;
  it.name = std::move(name);
  it.kind = kind;
  it.dtype = dtype;
  it.shape = std::move(shape);
  std::uint64_t n = ckpt::DTypeSize(dtype);
  for (auto d : it.shape) n *= static_cast<std::uint64_t>(d);
  it.length = n;
  return it;
}

// A whole shard file: the header as the writer renders it, then each item's bytes.
std::string Shard(ckpt::ShardMeta meta, std::vector<ckpt::ShardItem> items) {
  auto layout = ckpt::ShardLayout::Plan(std::move(meta), std::move(items));
  if (!layout.ok()) throw std::runtime_error(layout.status().message());
  std::string data;
  for (auto& it : layout->items()) {
    std::string bytes(it.length, '\0');
    for (std::size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<char>((i * 7 + it.name.size()) & 0xff);
    it.checksum = ckpt::Checksum::Of(bytes.data(), bytes.size());
    data += bytes;
  }
  return layout->RenderHeader() + data;
}

std::string Table(const std::vector<ckpt::TableItem>& items, std::uint32_t capacity) {
  auto table = ckpt::DescriptorTable::Create("", capacity);
  if (!table.ok()) throw std::runtime_error(table.status().message());
  if (ckpt::Status s = table->Write(items); !s.ok()) throw std::runtime_error(s.message());
  int fd = ::shm_open(table->name().c_str(), O_RDONLY | O_CLOEXEC, 0);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) throw std::runtime_error("cannot read table " + table->name());
  std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
  ssize_t r = ::pread(fd, bytes.data(), bytes.size(), 0);
  ::close(fd);
  if (r != static_cast<ssize_t>(bytes.size())) throw std::runtime_error("short read of " + table->name());
  return bytes;
}

ckpt::TableItem TableItem(std::string name, ckpt::DType dtype, std::vector<std::int64_t> shape,
                          std::string region, std::uint64_t offset) {
  ckpt::TableItem it;
  it.name = std::move(name);
  it.dtype = dtype;
  it.shape = std::move(shape);
  it.region = std::move(region);
  it.offset = offset;
  it.length = ckpt::DTypeSize(dtype);
  for (auto d : it.shape) it.length *= static_cast<std::uint64_t>(d);
  it.generation = 1;
  return it;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  using ckpt::DType;
  using ckpt::ItemKind;
  try {
    const fs::path shards = dir / "shard_header";
    Write(shards / "model-and-blob", Shard({"job-1", 42, 3, 8, "0123456789abcdef0123456789abcdef"},
                                           {Item("layer.0.weight", ItemKind::kTensor, DType::kF32, {4, 3}),
                                            Item("layer.0.bias", ItemKind::kTensor, DType::kBF16, {3}),
                                            Item("step", ItemKind::kTensor, DType::kI64, {}),
                                            Item("optimizer", ItemKind::kBlob, DType::kU8, {40})}));
    Write(shards / "empty-items",
          Shard({"j", 1, 0, 1, ""}, {Item("empty", ItemKind::kTensor, DType::kF16, {0, 5}),
                                     Item("mask", ItemKind::kTensor, DType::kBool, {2, 2}),
                                     Item("none", ItemKind::kBlob, DType::kU8, {0})}));
    Write(shards / "no-items",
          Shard({"job.x_y-z", 18446744073709551615ull, 4294967294u, 4294967295u, ""}, {}));
    Write(shards / "all-dtypes",
          Shard({"dt", 7, 1, 2, "s"}, {Item("f64", ItemKind::kTensor, DType::kF64, {1}),
                                       Item("f16", ItemKind::kTensor, DType::kF16, {1}),
                                       Item("f8a", ItemKind::kTensor, DType::kF8E4M3, {1}),
                                       Item("f8b", ItemKind::kTensor, DType::kF8E5M2, {1}),
                                       Item("i32", ItemKind::kTensor, DType::kI32, {1}),
                                       Item("i16", ItemKind::kTensor, DType::kI16, {1}),
                                       Item("i8", ItemKind::kTensor, DType::kI8, {1}),
                                       Item("u64", ItemKind::kTensor, DType::kU64, {1}),
                                       Item("u32", ItemKind::kTensor, DType::kU32, {1}),
                                       Item("u16", ItemKind::kTensor, DType::kU16, {1}),
                                       Item("u8", ItemKind::kTensor, DType::kU8, {1, 1, 1, 1, 1, 1, 1, 1})}));

    const fs::path tables = dir / "descriptor_table";
    Write(tables / "empty", Table({}, 1));
    Write(tables / "two-items",
          Table({TableItem("layer.0.weight", DType::kF32, {4, 3}, "/ckpt-job-1-r0-state", 0),
                 TableItem("step", DType::kI64, {}, "/ckpt-job-1-r0-state", 64)},
                4));
    Write(tables / "cuda-and-limits",
          Table({TableItem(std::string(ckpt::kMaxNameBytes, 'n'), DType::kBF16, {1, 2, 3, 4, 5, 6, 7, 8},
                           "cuda:GPU-00000000-0000-0000-0000-000000000000:0", 4096),
                 TableItem("mask", DType::kBool, {0}, std::string(ckpt::kMaxRegionNameBytes, 'r'), 0)},
                2));

    const fs::path latest = dir / "latest";
    Write(latest / "rendered-42", ckpt::RenderLatest(42));
    Write(latest / "rendered-0", ckpt::RenderLatest(0));
    Write(latest / "rendered-max", ckpt::RenderLatest(18446744073709551615ull));

    const fs::path committed = dir / "committed";
    Write(committed / "rendered", ckpt::RenderCommitted({"job-1", 42, 8, 1764612000}));
    Write(committed / "rendered-limits",
          ckpt::RenderCommitted({"a", 18446744073709551615ull, 4294967295u, -9223372036854775807 - 1}));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-fuzz-seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
