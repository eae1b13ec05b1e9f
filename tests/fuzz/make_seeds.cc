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
#include "format/global_layout.h"
#include "format/limits.h"
#include "format/markers.h"
#include "format/shard_format.h"
#include "format/version_index.h"
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
    if (it.blocks.block_bytes != 0)
      it.blocks.sums = ckpt::ComputeBlockSums(bytes.data(), bytes.size(), it.blocks.block_bytes);
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

// `item` as a box of global tensor `global` (with block checksums of `block_bytes`), or
// replicated when `offsets` is empty.
ckpt::ShardItem LaidOut(ckpt::ShardItem item, std::string global, std::vector<std::int64_t> shape,
                        std::vector<std::int64_t> offsets, std::uint64_t block_bytes = ckpt::kMinBlockBytes) {
  ckpt::GlobalLayout l;
  l.global_name = std::move(global);
  l.replicated = offsets.empty() && shape.empty();
  l.global_shape = std::move(shape);
  l.offsets = std::move(offsets);
  if (ckpt::Status s = ckpt::ResolveLayout(item.name, item.shape, &l); !s.ok())
    throw std::runtime_error(s.message());
  if (!l.replicated) item.blocks.block_bytes = block_bytes;
  item.layout = std::move(l);
  return item;
}

std::string Bytes4(std::uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }

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
    Write(
        shards / "no-items",
        Shard({"job.x_y-z", 18446744073709551615ull, ckpt::kMaxWorldSize - 1, ckpt::kMaxWorldSize, ""}, {}));
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

    // Format 3: a box with block checksums over several blocks, a replicated item, a private
    // one, a blob for one rank.
    ckpt::ShardItem for_rank = Item("sampler", ItemKind::kBlob, DType::kU8, {9});
    for_rank.for_rank = 1;
    const std::vector<ckpt::ShardItem> format3 = {
        LaidOut(Item("emb.part", ItemKind::kTensor, DType::kF32, {2, 1500}), "emb", {8, 1500}, {2, 0}),
        LaidOut(Item("norm", ItemKind::kTensor, DType::kBF16, {5}), "norm", {}, {}),
        Item("step", ItemKind::kTensor, DType::kI64, {1}), for_rank};
    Write(shards / "format3-layouts", Shard({"job-3", 9, 1, 4, "reg"}, format3));

    // The index of a version of two ranks, as the daemon renders it.
    std::vector<ckpt::ShardInfo> infos(2);
    for (std::uint32_t r = 0; r < 2; ++r) {
      infos[r].meta = {"job-3", 9, r, 2, "reg"};
      infos[r].items = {
          LaidOut(Item("w", ItemKind::kTensor, DType::kF32, {2, 3}), "w", {2, 6}, {0, 3 * std::int64_t(r)}),
          LaidOut(Item("rows", ItemKind::kTensor, DType::kBF16, {1, 4}), "emb", {2, 4}, {std::int64_t(r), 0}),
          LaidOut(Item("norm", ItemKind::kTensor, DType::kF32, {3}), "norm", {}, {}),
          Item("step", ItemKind::kTensor, DType::kI64, {1}), Item("rng", ItemKind::kBlob, DType::kU8, {4})};
    }
    infos[0].items.push_back(for_rank);
    auto index = ckpt::VersionIndex::Build(infos);
    if (!index.ok()) throw std::runtime_error(index.status().message());
    const fs::path indexes = dir / "version_index";
    Write(indexes / "two-ranks", index->Render());
    ckpt::ShardInfo plain;
    plain.meta = {"j", 1, 0, 1, ""};
    plain.items = {Item("x", ItemKind::kTensor, DType::kU8, {0})};
    Write(indexes / "private-only", ckpt::VersionIndex::Build({plain}).value().Render());

    const fs::path values = dir / "layout_metadata";
    Write(values / "layout-box", std::string(1, '\0') + Bytes4(0) + ckpt::EncodeLayout(*format3[0].layout));
    Write(values / "layout-replicated",
          std::string(1, '\0') + Bytes4(0) + ckpt::EncodeLayout(*format3[1].layout));
    Write(values / "blocks", std::string(1, '\1') + Bytes4(12000) +
                                 ckpt::EncodeBlockSums({ckpt::kMinBlockBytes,
                                                        {0x0123456789abcdefull, 1, 0xffffffffffffffffull}}));
    Write(values / "blocks-none",
          std::string(1, '\1') + Bytes4(0) + ckpt::EncodeBlockSums({ckpt::kBlockBytes, {}}));
    Write(values / "for-rank", std::string(1, '\2') + Bytes4(4) + ckpt::EncodeForRank(3));

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
    Write(
        committed / "rendered-limits",
        ckpt::RenderCommitted({"a", 18446744073709551615ull, ckpt::kMaxWorldSize, -9223372036854775807 - 1}));

    const fs::path markers = dir / "markers";
    Write(markers / "node-marker", ckpt::RenderNodeMarker({{0, "reg-a"}, {3, "reg.b_c-9"}, {70000, "r"}}));
    Write(markers / "node-marker-one", ckpt::RenderNodeMarker({{4294967295u, std::string(128, 'x')}}));
    Write(markers / "restorable", ckpt::RenderRestorable({3, {{0, "reg-a"}, {1, "reg-b"}, {2, "reg-a"}}}));
    Write(markers / "restorable-one", ckpt::RenderRestorable({1, {{0, "z"}}}));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-fuzz-seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
