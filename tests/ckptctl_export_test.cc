// ckptctl export (tools/ckptctl/export.h): the planning (sizes as Hugging Face writes them, the
// packing of tensors into files, their names, the filter, the tiling of global tensors by their
// chunks), exports of checkpoint trees written here by hand (shards of 4 ranks made with
// ShardLayout, their index.json and COMMITTED), every byte of every exported tensor checked
// against the global tensor, and each error path, through RunExport and through the binary
// for the exit codes and the "ckptctl: export:" lines.
#include <ckpt/client.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "format/checksum.h"
#include "format/dtype.h"
#include "format/global_layout.h"
#include "format/markers.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/run_as.h"
#include "support/test_dirs.h"
#include "tools/ckptctl/export.h"

using namespace ckpt;
using namespace ckpt::test;
using ckptctl::ExportChunk;
using ckptctl::ExportOptions;
using ckptctl::ExportTensor;
namespace fs = std::filesystem;
using nlohmann::json;
// The index keeps its order, as the daemon's does: tensors are exported in it.
using OrderedJson = nlohmann::ordered_json;

namespace {

using Dims = std::vector<std::int64_t>;

std::uint64_t Volume(const Dims& shape) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

// The bytes of a global tensor: a pattern of its name and each byte's position.
std::string GlobalBytes(const std::string& name, DType dtype, const Dims& shape) {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : name) h = (h ^ c) * 16777619u;
  std::string bytes(Volume(shape) * DTypeSize(dtype), '\0');
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<char>((i * 131 + h + (i >> 8)) & 0xff);
  return bytes;
}

// The bytes of box (offsets, shape) of a global tensor, element by element.
std::string BoxBytes(const std::string& global, const Dims& global_shape, std::size_t element,
                     const Dims& offsets, const Dims& shape) {
  std::string out;
  const std::uint64_t n = Volume(shape);
  for (std::uint64_t e = 0; e < n; ++e) {
    std::uint64_t rest = e, at = 0, stride = 1;
    std::vector<std::uint64_t> idx(shape.size());
    for (std::size_t d = shape.size(); d-- > 0;) {
      idx[d] = rest % static_cast<std::uint64_t>(shape[d]);
      rest /= static_cast<std::uint64_t>(shape[d]);
    }
    for (std::size_t d = shape.size(); d-- > 0;) {
      at += (idx[d] + static_cast<std::uint64_t>(offsets[d])) * stride;
      stride *= static_cast<std::uint64_t>(global_shape[d]);
    }
    out.append(global, at * element, element);
  }
  return out;
}

// A checkpoint tree written by hand: shards of `world` ranks (ShardLayout, as the daemon
// writes them), index.json in the schema of HELPERS.md, COMMITTED.
class HandTree {
 public:
  // `layouts`: the shards record the global layouts of their items too (format 3), as the
  // daemon writes them; else they are format 2 and only the index knows the layouts.
  HandTree(std::string root, std::string job, std::uint64_t version, std::uint32_t world,
           bool layouts = false)
      : tree_(std::move(root)),
        job_(std::move(job)),
        version_(version),
        world_(world),
        layouts_(layouts),
        items_(world) {
    index_ = {{"format", "ckptd-index/1"},
              {"job", job_},
              {"version", version_},
              {"world_size", world_},
              {"tensors", OrderedJson::object()},
              {"private", OrderedJson::object()},
              {"blobs", OrderedJson::array()}};
  }

  struct Piece {
    std::uint32_t rank;
    Dims offsets, shape;
  };

  // A global tensor made of `pieces`, each an item named `name` on its rank.
  void Global(const std::string& name, DType dtype, const Dims& shape, const std::vector<Piece>& pieces) {
    const std::string bytes = GlobalBytes(name, dtype, shape);
    globals_[name] = bytes;
    OrderedJson chunks = OrderedJson::array();
    for (const auto& p : pieces) {
      Add(p.rank, name, ItemKind::kTensor, dtype, p.shape,
          BoxBytes(bytes, shape, DTypeSize(dtype), p.offsets, p.shape),
          GlobalLayout{name, shape, p.offsets, false});
      chunks.push_back({{"rank", p.rank},
                        {"file", ShardFileName(p.rank)},
                        {"key", name},
                        {"offsets", p.offsets},
                        {"shape", p.shape}});
    }
    index_["tensors"][name] = {{"dtype", std::string(DTypeName(dtype))},
                               {"shape", shape},
                               {"replicated", false},
                               {"chunks", chunks}};
  }

  // A tensor every rank holds whole.
  void Replicated(const std::string& name, DType dtype, const Dims& shape) {
    const std::string bytes = GlobalBytes(name, dtype, shape);
    globals_[name] = bytes;
    OrderedJson chunks = OrderedJson::array();
    for (std::uint32_t r = 0; r < world_; ++r) {
      Add(r, name, ItemKind::kTensor, dtype, shape, bytes,
          GlobalLayout{name, shape, Dims(shape.size(), 0), true});
      chunks.push_back({{"rank", r},
                        {"file", ShardFileName(r)},
                        {"key", name},
                        {"offsets", Dims(shape.size(), 0)},
                        {"shape", shape}});
    }
    index_["tensors"][name] = {
        {"dtype", std::string(DTypeName(dtype))}, {"shape", shape}, {"replicated", true}, {"chunks", chunks}};
  }

  void Private(std::uint32_t rank, const std::string& name, DType dtype, const Dims& shape) {
    const std::string bytes = GlobalBytes("rank" + std::to_string(rank) + "/" + name, dtype, shape);
    globals_["rank" + std::to_string(rank) + "/" + name] = bytes;
    Add(rank, name, ItemKind::kTensor, dtype, shape, bytes);
    const std::string r = std::to_string(rank);
    if (!index_["private"].contains(r)) index_["private"][r] = OrderedJson::array();
    index_["private"][r].push_back({{"name", name},
                                    {"file", ShardFileName(rank)},
                                    {"key", name},
                                    {"dtype", std::string(DTypeName(dtype))},
                                    {"shape", shape}});
  }

  void Blob(std::uint32_t rank, const std::string& name, const std::string& data) {
    globals_["rank" + std::to_string(rank) + "/__blob__/" + name] = data;
    Add(rank, name, ItemKind::kBlob, DType::kU8, {static_cast<std::int64_t>(data.size())}, data);
    index_["blobs"].push_back({{"rank", rank},
                               {"name", name},
                               {"file", ShardFileName(rank)},
                               {"key", std::string(kBlobPrefix) + name},
                               {"bytes", data.size()},
                               {"for_rank", nullptr}});
  }

  // Writes the shards, the index (unless !with_index) and COMMITTED (unless !committed).
  void Write(bool with_index = true, bool committed = true) {
    fs::create_directories(tree_.VersionDir(job_, version_));
    for (std::uint32_t r = 0; r < world_; ++r) {
      std::vector<ShardItem> items;
      for (const auto& it : items_[r]) items.push_back(it.item);
      auto layout = ShardLayout::Plan(ShardMeta{job_, version_, r, world_, ""}, items);
      REQUIRE(layout.ok());
      std::string data;
      for (std::size_t i = 0; i < layout->items().size(); ++i) {
        layout->items()[i].checksum = Checksum::Of(items_[r][i].bytes.data(), items_[r][i].bytes.size());
        REQUIRE(layout->items()[i].offset == data.size());
        data += items_[r][i].bytes;
      }
      Put(ShardPath(r), layout->RenderHeader() + data);
    }
    if (with_index) WriteIndex();
    if (committed) Put(tree_.CommittedMarker(job_, version_), RenderCommitted({job_, version_, world_, 1}));
  }

  void WriteIndex() { Put(tree_.VersionDir(job_, version_) + "/index.json", index_.dump(1)); }

  OrderedJson& index() { return index_; }
  const std::map<std::string, std::string>& globals() const { return globals_; }
  std::string ShardPath(std::uint32_t rank) const { return tree_.ShardPath(job_, version_, rank); }

  // Flips one byte of item `key` of `rank`'s shard (the header stays as it was).
  void Corrupt(std::uint32_t rank, const std::string& key) {
    auto info = ReadShardHeader(ShardPath(rank));
    REQUIRE(info.ok());
    for (const auto& item : info->items) {
      if (item.TensorKey() != key) continue;
      std::string file = ReadFile(ShardPath(rank));
      file[info->data_start + item.offset + item.length / 2] ^= 0x40;
      Put(ShardPath(rank), file);
      return;
    }
    FAIL("no item " << key);
  }

  static void Put(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    REQUIRE(out.good());
  }

 private:
  struct Item {
    ShardItem item;
    std::string bytes;
  };
  void Add(std::uint32_t rank, const std::string& name, ItemKind kind, DType dtype, const Dims& shape,
           std::string bytes, std::optional<GlobalLayout> layout = std::nullopt) {
    ShardItem item;
    if (layout && layouts_) {
      // In the header too (format 3), with block sums where the layout is not replicated.
      item.layout = std::move(layout);
      if (!item.layout->replicated) {
        item.blocks.block_bytes = kMinBlockBytes;
        item.blocks.sums = ComputeBlockSums(bytes.data(), bytes.size(), kMinBlockBytes);
      }
    }
    item.name = name;
    item.kind = kind;
    item.dtype = dtype;
    item.shape = shape;
    item.length = bytes.size();
    items_[rank].push_back({item, std::move(bytes)});
  }

  CheckpointTree tree_;
  std::string job_;
  std::uint64_t version_;
  std::uint32_t world_;
  bool layouts_;
  std::vector<std::vector<Item>> items_;
  OrderedJson index_;
  std::map<std::string, std::string> globals_;
};

// The tree most tests export: 4 ranks; "w" F32 [6, 8] split 2 x 2 (an N-d grid), "e" I64 [8]
// split in 4 along dimension 0, "c" F16 [4, 3, 2] split along dimension 1 (rank 3 holds an
// empty piece), "b" F32 [5] replicated, "step" I64 [1] private to every rank, a blob "rng".
void FillStandard(HandTree& t) {
  t.Global("w", DType::kF32, {6, 8},
           {{0, {0, 0}, {3, 4}}, {1, {0, 4}, {3, 4}}, {2, {3, 0}, {3, 4}}, {3, {3, 4}, {3, 4}}});
  t.Global("e", DType::kI64, {8}, {{0, {0}, {2}}, {1, {2}, {2}}, {2, {4}, {2}}, {3, {6}, {2}}});
  t.Global("c", DType::kF16, {4, 3, 2},
           {{0, {0, 0, 0}, {4, 1, 2}},
            {1, {0, 1, 0}, {4, 1, 2}},
            {2, {0, 2, 0}, {4, 1, 2}},
            {3, {0, 3, 0}, {4, 0, 2}}});
  t.Replicated("b", DType::kF32, {5});
  for (std::uint32_t r = 0; r < 4; ++r) {
    t.Private(r, "step", DType::kI64, {1});
    t.Blob(r, "rng", "rng state of rank " + std::to_string(r));
  }
}

// One exported safetensors file, parsed.
struct Exported {
  json header;
  std::string data;
  std::string Tensor(const std::string& name) const {
    const auto& off = header.at(name).at("data_offsets");
    return data.substr(off[0].get<std::size_t>(), off[1].get<std::size_t>() - off[0].get<std::size_t>());
  }
};

Exported ReadExported(const std::string& path) {
  const std::string file = ReadFile(path);
  REQUIRE(file.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[static_cast<std::size_t>(i)]);
  REQUIRE((8 + n) % 8 == 0);
  Exported e{json::parse(file.substr(8, n)), file.substr(8 + n)};
  // safetensors' own rule: the data offsets tile the data section with no gap.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (auto it = e.header.begin(); it != e.header.end(); ++it)
    if (it.key() != "__metadata__")
      spans.emplace_back(it.value()["data_offsets"][0], it.value()["data_offsets"][1]);
  std::sort(spans.begin(), spans.end());
  std::uint64_t at = 0;
  for (auto [b, end] : spans) {
    CHECK(b == at);
    at = end;
  }
  CHECK(at == e.data.size());
  return e;
}

// Every file the index names, each tensor checked against `want` (name -> bytes); returns the
// index.
json CheckExport(const std::string& out, const std::map<std::string, std::string>& want) {
  const json index = json::parse(ReadFile(out + "/model.safetensors.index.json"));
  std::map<std::string, std::string> seen;
  std::uint64_t total = 0;
  std::set<std::string> files;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) files.insert(it.value());
  for (const auto& f : files) {
    Exported e = ReadExported(out + "/" + f);
    CHECK(e.header["__metadata__"]["format"] == "pt");
    for (auto it = e.header.begin(); it != e.header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      INFO("tensor " << it.key() << " in " << f);
      CHECK(index["weight_map"][it.key()] == f);
      seen[it.key()] = e.Tensor(it.key());
      total += seen[it.key()].size();
    }
  }
  CHECK(index["metadata"]["total_size"] == total);
  CHECK(seen.size() == want.size());
  for (const auto& [name, bytes] : want) {
    INFO("tensor " << name);
    REQUIRE(seen.count(name) == 1);
    CHECK(seen[name] == bytes);
  }
  return index;
}

ExportOptions Options(const TempDir& dir, const std::string& out = "out") {
  ExportOptions o;
  o.root = dir.path() + "/root";
  o.job = "job";
  o.out = dir.path() + "/" + out;
  return o;
}

std::map<std::string, std::string> Without(std::map<std::string, std::string> m, const std::string& part) {
  for (auto it = m.begin(); it != m.end();)
    it = it->first.find(part) != std::string::npos ? m.erase(it) : ++it;
  return m;
}

bool Contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

ProcessResult Ctl(std::vector<std::string> args) {
  args.insert(args.begin(), {CKPTCTL_BINARY, "export"});
  return RunProcess(args);
}

}  // namespace

TEST_CASE("export sizes are read as Hugging Face writes them", "[export]") {
  CHECK(ckptctl::ParseByteSize("5GB").value() == 5'000'000'000ull);
  CHECK(ckptctl::ParseByteSize("500MB").value() == 500'000'000ull);
  CHECK(ckptctl::ParseByteSize("2GiB").value() == 2ull << 30);
  CHECK(ckptctl::ParseByteSize("2gib").value() == 2ull << 30);
  CHECK(ckptctl::ParseByteSize("10KiB").value() == 10240);
  CHECK(ckptctl::ParseByteSize("3KB").value() == 3000);
  CHECK(ckptctl::ParseByteSize("1TB").value() == 1'000'000'000'000ull);
  CHECK(ckptctl::ParseByteSize("1.5GB").value() == 1'500'000'000ull);
  CHECK(ckptctl::ParseByteSize("5 GB").value() == 5'000'000'000ull);
  CHECK(ckptctl::ParseByteSize("4096").value() == 4096);
  for (const char* bad : {"", "GB", "5XB", "0", "0GB", "-1GB", "1.2.3GB", "5 G B", "five", "5GBs", "1e3"}) {
    INFO(bad);
    auto r = ckptctl::ParseByteSize(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(r.status().message(), "--max-shard-size"));
    CHECK(Contains(r.status().message(), "5GB, 500MB, 2GiB"));
  }
  // transformers reads "5Gb" as gigabits, huggingface_hub as gigabytes: refused, not guessed.
  auto gb = ckptctl::ParseByteSize("5Gb");
  REQUIRE_FALSE(gb.ok());
  CHECK(Contains(gb.status().message(), "ambiguous"));
  CHECK_FALSE(ckptctl::ParseByteSize("5mb").ok());
}

TEST_CASE("export packs tensors into files as huggingface_hub splits a state dict, and names them so",
          "[export]") {
  using V = std::vector<std::size_t>;
  auto tensors = [](const std::vector<ckptctl::ExportFile>& files) {
    std::vector<V> out;
    for (const auto& f : files) out.push_back(f.tensors);
    return out;
  };
  // In order; a tensor that does not fit starts the next file.
  CHECK(tensors(ckptctl::PackFiles({2, 2, 2}, 4)) == std::vector<V>{{0, 1}, {2}});
  CHECK(tensors(ckptctl::PackFiles({3, 3, 3}, 5)) == std::vector<V>{{0}, {1}, {2}});
  CHECK(tensors(ckptctl::PackFiles({1, 2, 1}, 4)) == std::vector<V>{{0, 1, 2}});
  // A tensor larger than the limit alone in its file; the one after it starts another.
  CHECK(tensors(ckptctl::PackFiles({1, 1, 10, 1, 1}, 4)) == std::vector<V>{{0, 1}, {2}, {3, 4}});
  CHECK(tensors(ckptctl::PackFiles({10, 10}, 4)) == std::vector<V>{{0}, {1}});
  CHECK(tensors(ckptctl::PackFiles({4, 0, 4}, 4)) == std::vector<V>{{0, 1}, {2}});
  CHECK(ckptctl::PackFiles({}, 4).empty());
  auto files = ckptctl::PackFiles({1, 1, 10, 1, 1}, 4);
  CHECK(files[1].data_bytes == 10);
  CHECK(files[0].name == "model-00001-of-00003.safetensors");
  CHECK(files[2].name == "model-00003-of-00003.safetensors");
  CHECK(ckptctl::PackFiles({1, 2}, 100)[0].name == "model.safetensors");
  CHECK(ckptctl::ExportFileName(9, 12) == "model-00010-of-00012.safetensors");
}

TEST_CASE("export filter: a regex searched in the exported names, blobs only when asked", "[export]") {
  auto make = [] {
    std::vector<ExportTensor> ts(4);
    ts[0].name = "model.layers.0.weight";
    ts[1].name = "model.layers.1.weight";
    ts[2].name = "rank0/step";
    ts[2].kind = ExportTensor::Kind::kPrivate;
    ts[3].name = "rank0/__blob__/rng";
    ts[3].kind = ExportTensor::Kind::kBlob;
    return ts;
  };
  auto names = [](const std::vector<ExportTensor>& ts) {
    std::vector<std::string> out;
    for (const auto& t : ts) out.push_back(t.name);
    return out;
  };
  auto ts = make();
  std::size_t skipped = 0;
  REQUIRE(ckptctl::SelectTensors(ts, "", false, &skipped).ok());
  CHECK(names(ts) ==
        std::vector<std::string>{"model.layers.0.weight", "model.layers.1.weight", "rank0/step"});
  CHECK(skipped == 1);
  ts = make();
  REQUIRE(ckptctl::SelectTensors(ts, "layers\\.1", true, &skipped).ok());
  CHECK(names(ts) == std::vector<std::string>{"model.layers.1.weight"});
  ts = make();
  REQUIRE(ckptctl::SelectTensors(ts, "^rank0/", true, &skipped).ok());
  CHECK(names(ts) == std::vector<std::string>{"rank0/step", "rank0/__blob__/rng"});
  CHECK(skipped == 0);

  ts = make();
  ckpt::Status none = ckptctl::SelectTensors(ts, "^decoder\\.", false, &skipped);
  CHECK(none.code() == StatusCode::kNotFound);
  CHECK(Contains(none.message(), "--filter '^decoder\\.' matches none of the 4 tensors"));
  ts = make();
  ckpt::Status only_blob = ckptctl::SelectTensors(ts, "rng", false, &skipped);
  CHECK(only_blob.code() == StatusCode::kNotFound);
  CHECK(Contains(only_blob.message(), "--blobs"));
  ts = make();
  ckpt::Status bad = ckptctl::SelectTensors(ts, "layers.(", false, &skipped);
  CHECK(bad.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(bad.message(), "--filter 'layers.(' is not a valid regular expression"));
}

TEST_CASE("export tiling: chunks must cover a global tensor exactly, a replicated copy whole", "[export]") {
  ExportTensor t;
  t.name = "w";
  t.dtype = DType::kF32;
  t.shape = {4, 6};
  auto chunk = [](std::uint32_t rank, Dims o, Dims s) {
    return ExportChunk{rank, ShardFileName(rank), "w", o, s};
  };
  t.chunks = {chunk(0, {0, 0}, {2, 3}), chunk(1, {0, 3}, {2, 3}), chunk(2, {2, 0}, {2, 6})};
  CHECK(ckptctl::CheckTiling(t).ok());

  ExportTensor gap = t;
  gap.chunks.pop_back();
  ckpt::Status s = ckptctl::CheckTiling(gap);
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK(Contains(s.message(), "tensor 'w': its 2 chunks cover 12 of its 24 elements [4,6]"));

  ExportTensor overlap = t;
  overlap.chunks[2] = chunk(2, {1, 0}, {3, 6});
  s = ckptctl::CheckTiling(overlap);
  CHECK(Contains(s.message(), "the chunks of rank 0 [0:2, 0:3] and rank 2 [1:4, 0:6] overlap"));

  ExportTensor outside = t;
  outside.chunks[1] = chunk(1, {0, 4}, {2, 3});
  s = ckptctl::CheckTiling(outside);
  CHECK(
      Contains(s.message(), "the chunk of rank 1 ('w') covers [0:2, 4:7], outside the tensor's shape [4,6]"));

  ExportTensor dims = t;
  dims.chunks[0] = chunk(0, {0}, {2});
  s = ckptctl::CheckTiling(dims);
  CHECK(Contains(s.message(), "has 1 dimensions, the tensor 2"));

  ExportTensor rep = t;
  rep.replicated = true;
  rep.chunks = {chunk(0, {0, 0}, {4, 6}), chunk(1, {0, 0}, {4, 6})};
  CHECK(ckptctl::CheckTiling(rep).ok());
  rep.chunks[1] = chunk(1, {0, 0}, {2, 6});
  s = ckptctl::CheckTiling(rep);
  CHECK(Contains(s.message(), "the tensor is replicated: every copy is [4,6] whole"));

  ExportTensor scalar;
  scalar.name = "s";
  scalar.dtype = DType::kF32;
  scalar.chunks = {chunk(0, {}, {})};
  CHECK(ckptctl::CheckTiling(scalar).ok());
  scalar.chunks.push_back(chunk(1, {}, {}));
  CHECK(Contains(ckptctl::CheckTiling(scalar).message(), "overlap"));
}

TEST_CASE("export of 4 ranks: every global tensor whole, private items as rank<R>/<name>, one index",
          "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 3, 4);
  FillStandard(tree);
  tree.Write();

  auto src = ckptctl::LoadExportSource(dir.path() + "/root", "job", 0);
  REQUIRE(src.ok());
  CHECK(src->version == 3);
  CHECK(src->world_size == 4);
  CHECK(src->from_index);

  auto report = ckptctl::RunExport(Options(dir));
  INFO(report.status().message());
  REQUIRE(report.ok());
  CHECK(report->skipped_blobs == 4);
  REQUIRE(report->files.size() == 1);
  CHECK(ListFiles(dir.path() + "/out") ==
        std::vector<std::string>{"model.safetensors", "model.safetensors.index.json"});
  json index = CheckExport(dir.path() + "/out", Without(tree.globals(), "__blob__"));
  CHECK(index["weight_map"]["rank2/step"] == "model.safetensors");
  // Global tensors by name, then private items by rank; in the file by decreasing element size.
  CHECK(report->tensor_names ==
        std::vector<std::string>{"b", "c", "e", "w", "rank0/step", "rank1/step", "rank2/step", "rank3/step"});
  Exported e = ReadExported(dir.path() + "/out/model.safetensors");
  CHECK(e.header["__metadata__"]["ckpt.job"] == "job");
  CHECK(e.header["__metadata__"]["ckpt.version"] == "3");
  CHECK(e.header["w"]["shape"] == Dims{6, 8});
  CHECK(e.header["c"]["dtype"] == "F16");
  CHECK(e.header["e"]["data_offsets"][0] == 0);  // I64 first

  SECTION("--blobs exports them as U8 tensors rank<R>/__blob__/<name>") {
    ExportOptions o = Options(dir, "out-blobs");
    o.blobs = true;
    auto r = ckptctl::RunExport(o);
    REQUIRE(r.ok());
    CHECK(r->skipped_blobs == 0);
    json idx = CheckExport(o.out, tree.globals());
    CHECK(idx["weight_map"].contains("rank3/__blob__/rng"));
    CHECK(ReadExported(o.out + "/model.safetensors").header["rank3/__blob__/rng"]["dtype"] == "U8");
  }
  SECTION("a small --max-shard-size makes several files, a tensor above it alone in its own") {
    ExportOptions o = Options(dir, "out-small");
    o.max_shard_bytes = 90;  // b (20 bytes) and c (48) fit one file, e (64) not with them, w (192) is above
    auto r = ckptctl::RunExport(o);
    REQUIRE(r.ok());
    REQUIRE(r->files.size() == 4);
    CHECK(r->files[0].tensors == std::vector<std::size_t>{0, 1});
    CHECK(r->files[1].tensors == std::vector<std::size_t>{2});
    CHECK(r->files[2].tensors == std::vector<std::size_t>{3});
    CHECK(r->files[2].data_bytes == 192);
    CHECK(r->files[3].tensors == std::vector<std::size_t>{4, 5, 6, 7});
    json idx = CheckExport(o.out, Without(tree.globals(), "__blob__"));
    CHECK(idx["weight_map"]["w"] == "model-00003-of-00004.safetensors");
    CHECK(idx["weight_map"]["rank3/step"] == "model-00004-of-00004.safetensors");
    CHECK(ListFiles(o.out).size() == 5);
  }
  SECTION("--filter exports what it finds and nothing else") {
    ExportOptions o = Options(dir, "out-filter");
    o.filter = "^(w|rank1/)";
    auto r = ckptctl::RunExport(o);
    REQUIRE(r.ok());
    CheckExport(o.out, {{"w", tree.globals().at("w")}, {"rank1/step", tree.globals().at("rank1/step")}});
  }
  SECTION("a replicated copy that fails its checksum is passed over with a warning") {
    tree.Corrupt(0, "b");
    auto r = ckptctl::RunExport(Options(dir, "out-rep"));
    REQUIRE(r.ok());
    REQUIRE(r->warnings.size() == 1);
    CHECK(Contains(r->warnings[0], "rank-00000.safetensors (rank 0): item 'b'"));
    CheckExport(dir.path() + "/out-rep", Without(tree.globals(), "__blob__"));
  }
}

TEST_CASE("export of a version without index.json: every item of every rank as rank<R>/<name>", "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 1, 2);
  tree.Private(0, "a", DType::kF32, {3, 2});
  tree.Private(1, "a", DType::kF32, {3, 2});
  tree.Private(1, "scalar", DType::kBF16, {});
  tree.Blob(0, "cfg", "{}");
  tree.Write(/*with_index=*/false);
  ExportOptions o = Options(dir);
  o.blobs = true;
  auto r = ckptctl::RunExport(o);
  INFO(r.status().message());
  REQUIRE(r.ok());
  CHECK_FALSE(r->from_index);
  CheckExport(o.out, tree.globals());
}

TEST_CASE("export of what a real ckptd wrote for 4 ranks declaring layouts, from its index.json",
          "[export]") {
  TempDir dir("export");
  DaemonOptions opts;
  opts.root = dir.path() + "/root";
  opts.socket = dir.path() + "/sock/ckptd.sock";
  DaemonProcess daemon(opts);
  struct Piece {
    std::string item, global;
    DType dtype;
    Dims global_shape, offsets, shape;
  };
  std::map<std::string, std::string> want;
  std::vector<Client> clients;
  std::vector<std::shared_ptr<SharedRegion>> regions;
  for (std::uint32_t r = 0; r < 4; ++r) {
    const std::int64_t ri = r;
    const std::vector<Piece> pieces = {
        {"w", "w", DType::kF32, {6, 8}, {ri / 2 * 3, ri % 2 * 4}, {3, 4}},
        {"e.part", "e", DType::kI64, {8}, {2 * ri}, {2}},
        {"b", "b", DType::kF32, {5}, {0}, {5}},
        {"step", "", DType::kI64, {1}, {0}, {1}},
    };
    std::string bytes;
    std::vector<std::pair<std::uint64_t, const Piece*>> at;
    for (const auto& p : pieces) {
      const std::string name = p.global.empty() ? "rank" + std::to_string(r) + "/" + p.item : p.global;
      const std::string global = GlobalBytes(name, p.dtype, p.global_shape);
      want[name] = global;
      at.emplace_back(bytes.size(), &p);
      bytes += BoxBytes(global, p.global_shape, DTypeSize(p.dtype), p.offsets, p.shape);
    }
    regions.push_back(SharedRegion::create(bytes.size()));
    std::memcpy(regions.back()->data(), bytes.data(), bytes.size());
    std::vector<TensorItem> items;
    for (const auto& [offset, p] : at) {
      TensorItem t{p->item, p->dtype, p->shape, regions.back(), offset, nullptr, std::nullopt};
      if (p->item == "b")
        t.layout = Layout{"", {}, {}, true};
      else if (!p->global.empty())
        t.layout = Layout{p->global, p->global_shape, p->offsets, false};
      items.push_back(std::move(t));
    }
    clients.push_back(Client::connect(daemon.socket()));
    clients.back().register_items("job", r, 4, items);
  }
  for (std::uint32_t r = 0; r < 4; ++r) clients[r].snapshot(1, {Blob{"rng", "rank " + std::to_string(r)}});
  for (auto& c : clients) c.wait_durable(1, Level::kCommitted, std::chrono::seconds(60));
  REQUIRE(fs::exists(dir.path() + "/root/job/v0000000001/index.json"));

  ExportOptions o = Options(dir);
  o.max_shard_bytes = 64;  // by name: b (20 bytes), e (64), w (192: above), then the 4 steps
  auto r = ckptctl::RunExport(o);
  INFO(r.status().message());
  REQUIRE(r.ok());
  CHECK(r->from_index);
  CHECK(r->skipped_blobs == 4);
  CHECK(r->files.size() == 4);
  CheckExport(o.out, want);
}

TEST_CASE("export of format 3 shards: with the index, and without it from the layouts in their headers",
          "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 2, 4, /*layouts=*/true);
  FillStandard(tree);
  tree.Write();
  REQUIRE(ReadShardHeader(tree.ShardPath(0))->format_version == "3");
  auto r = ckptctl::RunExport(Options(dir));
  INFO(r.status().message());
  REQUIRE(r.ok());
  CHECK(r->from_index);
  CheckExport(dir.path() + "/out", Without(tree.globals(), "__blob__"));

  fs::remove(dir.path() + "/root/job/v0000000002/index.json");
  ExportOptions o = Options(dir, "out-headers");
  o.blobs = true;
  r = ckptctl::RunExport(o);
  INFO(r.status().message());
  REQUIRE(r.ok());
  CHECK_FALSE(r->from_index);
  CheckExport(o.out, tree.globals());
}

TEST_CASE("export errors name the job, version, tensor, shard or path at fault", "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 3, 4);
  FillStandard(tree);
  tree.Write();
  auto fails = [&](ExportOptions o, StatusCode code, const std::string& says) {
    auto r = ckptctl::RunExport(o);
    REQUIRE_FALSE(r.ok());
    INFO(r.status().message());
    CHECK(r.status().code() == code);
    CHECK(Contains(r.status().message(), says));
    // Never a half-written export: the output directory was not created, or is as it was.
    CHECK_FALSE(fs::exists(o.out));
  };

  SECTION("unknown job") {
    ExportOptions o = Options(dir);
    o.job = "nosuch";
    fails(o, StatusCode::kNotFound, "no job 'nosuch' under " + dir.path() + "/root");
  }
  SECTION("a job id that is not one") {
    ExportOptions o = Options(dir);
    o.job = "../etc";
    fails(o, StatusCode::kInvalidArgument, "job id '../etc'");
  }
  SECTION("no such version") {
    ExportOptions o = Options(dir);
    o.version = 9;
    fails(o, StatusCode::kNotFound, "job 'job' has no version 9");
  }
  SECTION("a version that is not committed") {
    HandTree v4(dir.path() + "/root", "job", 4, 4);
    FillStandard(v4);
    v4.Write(true, /*committed=*/false);
    ExportOptions o = Options(dir);
    o.version = 4;
    fails(o, StatusCode::kNotFound, "version 4 of job 'job' is not committed (no ");
    // The newest committed is still 3.
    o.version = 0;
    REQUIRE(ckptctl::RunExport(o).ok());
  }
  SECTION("a job without any committed version") {
    HandTree other(dir.path() + "/root", "fresh", 1, 1);
    other.Private(0, "x", DType::kU8, {1});
    other.Write(true, /*committed=*/false);
    ExportOptions o = Options(dir);
    o.job = "fresh";
    fails(o, StatusCode::kNotFound, "job 'fresh' under " + dir.path() + "/root has no committed version");
  }
  SECTION("a filter that matches nothing, a bad regex") {
    ExportOptions o = Options(dir);
    o.filter = "^nothing$";
    fails(o, StatusCode::kNotFound, "--filter '^nothing$' matches none of the 12 tensors");
    o.filter = "[";
    fails(o, StatusCode::kInvalidArgument, "not a valid regular expression");
  }
  SECTION("chunks that do not tile a global tensor") {
    tree.index()["tensors"]["w"]["chunks"].erase(3);
    tree.WriteIndex();
    fails(Options(dir), StatusCode::kDataLoss, "tensor 'w': its 3 chunks cover 36 of its 48 elements");
  }
  SECTION("a corrupted chunk of a global tensor") {
    tree.Corrupt(2, "w");
    fails(Options(dir), StatusCode::kDataLoss,
          "corrupted shard " + tree.ShardPath(2) +
              " (rank 2): item 'w', chunk [3:6, 0:4] of tensor 'w', fails its checksum");
  }
  SECTION("a corrupted private item") {
    tree.Corrupt(1, "step");
    fails(Options(dir), StatusCode::kDataLoss,
          "corrupted shard " + tree.ShardPath(1) + " (rank 1): item 'step'");
  }
  SECTION("every copy of a replicated tensor corrupted") {
    for (std::uint32_t r = 0; r < 4; ++r) tree.Corrupt(r, "b");
    fails(Options(dir), StatusCode::kDataLoss, "replicated tensor 'b': no copy is intact");
  }
  SECTION("a shard whose header was changed") {
    std::string file = ReadFile(tree.ShardPath(1));
    auto at = file.find("\"F32\"");
    REQUIRE(at != std::string::npos);
    file.replace(at, 5, "\"I32\"");
    HandTree::Put(tree.ShardPath(1), file);
    fails(Options(dir), StatusCode::kDataLoss, "corrupted shard of rank 1: ");
  }
  SECTION("a missing shard; a filter that leaves its tensors out saves the rest") {
    fs::remove(tree.ShardPath(3));
    fails(Options(dir), StatusCode::kDataLoss, "is committed but rank 3's shard cannot be opened");
    ExportOptions o = Options(dir);
    o.filter = "^rank[0-2]/";
    auto r = ckptctl::RunExport(o);
    INFO(r.status().message());
    REQUIRE(r.ok());
    CHECK(r->tensor_names == std::vector<std::string>{"rank0/step", "rank1/step", "rank2/step"});
  }
  SECTION("an index that names an item the shard does not hold, or with another shape") {
    tree.index()["tensors"]["e"]["chunks"][1]["key"] = "nope";
    tree.WriteIndex();
    fails(Options(dir), StatusCode::kDataLoss, "tensor 'e': the chunk of rank 1 is item 'nope', which ");
    tree.index()["tensors"]["e"]["chunks"][1]["key"] = "e";
    tree.index()["tensors"]["e"]["chunks"][1]["shape"] = Dims{3};
    tree.WriteIndex();
    fails(Options(dir), StatusCode::kDataLoss, "is listed in the index as I64 [3] but");
  }
  SECTION("an index that is not one") {
    HandTree::Put(dir.path() + "/root/job/v0000000003/index.json",
                  "{\"format\": \"ckptd-index/1\", \"job\": 3}");
    fails(Options(dir), StatusCode::kDataLoss, "index.json: top level: lacks \"version\"");
    tree.index()["tensors"]["w"]["chunks"][0]["file"] = "../../etc/passwd";
    tree.WriteIndex();
    fails(Options(dir), StatusCode::kDataLoss,
          "index.json: tensors.'w'.chunks[0].file: is not rank-00000.safetensors, the shard of rank 0");
    tree.index()["tensors"]["w"]["chunks"][0]["file"] = "rank-00000.safetensors";
    tree.index()["tensors"]["w"]["chunks"][0]["rank"] = 7;
    tree.WriteIndex();
    fails(Options(dir), StatusCode::kDataLoss,
          "index.json: tensors.'w'.chunks[0].rank: is not an integer from 0 to 3");
  }
  SECTION("interrupted") {
    ExportOptions o = Options(dir);
    volatile std::sig_atomic_t flag = 1;
    o.interrupted = &flag;
    fails(o, StatusCode::kCancelled, "interrupted");
  }
}

TEST_CASE("export into a directory with files: refused without --force, replaced with it, never half-written",
          "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 3, 4);
  FillStandard(tree);
  tree.Write();
  const std::string out = dir.path() + "/out";
  fs::create_directories(out);
  HandTree::Put(out + "/config.json", "{}");
  HandTree::Put(out + "/model-00001-of-00009.safetensors", "stale");

  auto r = ckptctl::RunExport(Options(dir));
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kAlreadyExists);
  CHECK(Contains(r.status().message(), "--out " + out + " already has 2 entries ('config.json', ...)"));
  CHECK(Contains(r.status().message(), "--force"));

  // A failure half way (a tensor of the last of 3 files is corrupted) leaves the directory as it was.
  ExportOptions o = Options(dir);
  o.force = true;
  o.max_shard_bytes = 100;
  tree.Corrupt(1, "c");
  r = ckptctl::RunExport(o);
  REQUIRE_FALSE(r.ok());
  CHECK(ListFiles(out) == std::vector<std::string>{"config.json", "model-00001-of-00009.safetensors"});
  CHECK(fs::directory_entry(out + "/.ckptctl-export-" + std::to_string(::getpid()) + ".tmp").exists() ==
        false);

  HandTree fresh(dir.path() + "/root", "job", 3, 4);  // the same tree, rewritten intact
  FillStandard(fresh);
  fresh.Write();
  r = ckptctl::RunExport(o);
  INFO(r.status().message());
  REQUIRE(r.ok());
  std::vector<std::string> want = {"config.json", "model.safetensors.index.json"};
  for (std::size_t i = 0; i < r->files.size(); ++i) want.push_back(r->files[i].name);
  std::sort(want.begin(), want.end());
  CHECK(ListFiles(out) == want);  // the stale file of the earlier export is gone, config.json kept
  CheckExport(out, Without(fresh.globals(), "__blob__"));

  // --out that is a symbolic link to a directory is that directory.
  fs::create_directories(dir.path() + "/real");
  fs::create_directory_symlink(dir.path() + "/real", dir.path() + "/link");
  r = ckptctl::RunExport(Options(dir, "link"));
  INFO(r.status().message());
  REQUIRE(r.ok());
  CheckExport(dir.path() + "/real", Without(fresh.globals(), "__blob__"));

  // --out that is a file, or under one.
  HandTree::Put(dir.path() + "/file", "x");
  ExportOptions f = Options(dir, "file");
  r = ckptctl::RunExport(f);
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(r.status().message(), "--out " + dir.path() + "/file is a regular file, not a directory"));
  f = Options(dir, "file/sub");
  r = ckptctl::RunExport(f);
  CHECK(r.status().code() == StatusCode::kIoError);
  CHECK(Contains(r.status().message(), "cannot create --out " + dir.path() + "/file/sub"));
}

TEST_CASE("ckptctl export: exit codes and error lines of the command", "[export]") {
  TempDir dir("export");
  HandTree tree(dir.path() + "/root", "job", 3, 4);
  FillStandard(tree);
  tree.Write();
  const std::string root = dir.path() + "/root", out = dir.path() + "/out";
  auto run_job = [&](const std::string& job, std::vector<std::string> extra, int code,
                     const std::string& says) {
    std::vector<std::string> args = {"--root", root, "--job", job, "--out", out};
    args.insert(args.end(), extra.begin(), extra.end());
    ProcessResult r = Ctl(args);
    INFO(r.output);
    CHECK(r.exit_code == code);
    CHECK(Contains(r.output, says));
    return r;
  };
  auto run = [&](std::vector<std::string> extra, int code, const std::string& says) {
    return run_job("job", std::move(extra), code, says);
  };
  run({"--max-shard-size", "5XB"}, 2, "ckptctl: --max-shard-size '5XB': unknown unit 'XB'");
  run({"--filter", "("}, 2, "ckptctl: export: --filter '(' is not a valid regular expression");
  run_job("nosuch", {}, 3, "ckptctl: export: no job 'nosuch'");
  run({"--version", "7"}, 3, "ckptctl: export: job 'job' has no version 7");
  run({"--filter", "zzz"}, 3, "ckptctl: export: --filter 'zzz' matches none");

  ProcessResult ok = run({"--max-shard-size", "90", "--json"}, 0, "\"total_size\"");
  json report = json::parse(ok.output);
  CHECK(report["files"].size() == 4);
  CHECK(report["skipped_blobs"] == 4);
  run({}, 2, "ckptctl: export: --out " + out + " already has 5 entries");
  ProcessResult text = run({"--force", "--blobs"}, 0, "exported job job version 3 (4 ranks): 12 tensors");
  CHECK(Contains(text.output, "model.safetensors "));

  tree.Corrupt(0, "w");
  run({"--force"}, 4, "ckptctl: export: corrupted shard " + tree.ShardPath(0));

  // An output directory this user cannot write.
  const std::string locked = dir.path() + "/locked";
  fs::create_directories(locked);
  ::chmod(locked.c_str(), 0555);
  ::chmod(dir.path().c_str(), 0755);
  std::vector<std::string> argv = {CKPTCTL_BINARY, "export",   "--root", root,    "--job",
                                   "job",          "--filter", "^e$",    "--out", locked + "/sub"};
  HandTree fresh(root, "job", 3, 4);
  FillStandard(fresh);
  fresh.Write();
  ProcessResult r = ::geteuid() == 0 ? RunAs(65534, argv) : RunProcess(argv);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(Contains(r.output, "ckptctl: export: cannot create --out " + locked + "/sub"));
  CHECK(Contains(r.output, "Permission denied"));
}
