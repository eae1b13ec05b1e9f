// Global layouts through real ckptd processes: registration checks them, the shards carry them
// (format 3, with per-block checksums computed while the flush writes), and every committed
// version gets its index.json on the persistent tier before COMMITTED.
#include <ckpt/client.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/pipeline/item_hasher.h"
#include "format/checksum.h"
#include "format/global_layout.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "format/version_index.h"
#include "shm/descriptor_table.h"
#include "support/byte_pattern.h"
#include "support/daemon_process.h"
#include "support/shard_path.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

constexpr std::uint32_t kWorld = 4;
// "emb" rows are long enough that each rank's piece spans blocks and pool chunks (1 MiB).
constexpr std::int64_t kEmbCols = 150'000;

// The value of element `flat` of global tensor `name` at `version`: what every rank's piece
// of it holds, so the assembled tensor can be checked element by element.
float GlobalValue(const std::string& name, std::uint64_t flat, std::uint64_t version) {
  std::uint64_t h = std::hash<std::string>{}(name) ^ (version * 0x9e3779b97f4a7c15ull);
  return static_cast<float>((flat * 2654435761u + h) % 1000003) * 0.5f;
}

std::uint64_t Flat(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& index) {
  std::uint64_t flat = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// Fills a box (offsets, box shape) of global tensor `name` of `global` shape, row-major.
void FillBox(float* out, const std::string& name, const std::vector<std::int64_t>& global,
             const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& box,
             std::uint64_t version) {
  std::uint64_t n = 1;
  for (auto d : box) n *= d;
  std::vector<std::int64_t> idx(box.size(), 0);
  for (std::uint64_t i = 0; i < n; ++i) {
    std::vector<std::int64_t> g(box.size());
    for (std::size_t d = 0; d < box.size(); ++d) g[d] = offsets[d] + idx[d];
    out[i] = GlobalValue(name, Flat(global, g), version);
    for (std::size_t d = box.size(); d-- > 0;) {
      if (++idx[d] < box[d]) break;
      idx[d] = 0;
    }
  }
}

// One rank of a sharded model: "w" [4, 6] in a 2x2 grid, "emb" [8, kEmbCols] split by rows,
// "norm" replicated, "step" private.
struct ShardedRank {
  std::uint32_t rank;
  std::shared_ptr<SharedRegion> region;
  struct Piece {
    std::string item, global;
    std::vector<std::int64_t> shape, global_shape, offsets;
    bool replicated = false;
    bool private_item = false;
    std::uint64_t at = 0;  // offset in the region
  };
  std::vector<Piece> pieces;
  std::unique_ptr<Client> client;

  explicit ShardedRank(std::uint32_t r) : rank(r) {
    pieces.push_back({"w", "w", {2, 3}, {4, 6}, {std::int64_t(r / 2) * 2, std::int64_t(r % 2) * 3}});
    pieces.push_back({"emb.part", "emb", {2, kEmbCols}, {8, kEmbCols}, {2 * std::int64_t(r), 0}});
    pieces.push_back({"norm", "norm", {16}, {16}, {0}, true});
    pieces.push_back({"step", "", {1}, {1}, {0}, false, true});
    std::uint64_t bytes = 0;
    for (auto& p : pieces) {
      p.at = bytes;
      std::uint64_t n = 1;
      for (auto d : p.shape) n *= d;
      bytes += (p.private_item ? 8 : 4) * n;
    }
    region = SharedRegion::create(bytes);
  }
  std::vector<TensorItem> Items() const {
    std::vector<TensorItem> out;
    for (const auto& p : pieces) {
      TensorItem t{p.item,      p.private_item ? DType::kI64 : DType::kF32, p.shape, region, p.at, nullptr,
                   std::nullopt};
      if (!p.private_item) {
        Layout l;
        l.global_name = p.global == p.item ? "" : p.global;
        l.replicated = p.replicated;
        if (!p.replicated) {
          l.global_shape = p.global_shape;
          l.offsets = p.offsets;
        }
        t.layout = l;
      }
      out.push_back(std::move(t));
    }
    return out;
  }
  void Fill(std::uint64_t version) {
    char* base = static_cast<char*>(region->data());
    for (const auto& p : pieces) {
      if (p.private_item) {
        const std::int64_t step = static_cast<std::int64_t>(version * 10 + rank);
        std::memcpy(base + p.at, &step, 8);
      } else {
        FillBox(reinterpret_cast<float*>(base + p.at), p.global, p.global_shape, p.offsets, p.shape, version);
      }
    }
  }
};

std::string ReadRange(const std::string& path, std::uint64_t offset, std::uint64_t len) {
  const std::string all = ReadFile(path);
  REQUIRE(offset + len <= all.size());
  return all.substr(offset, len);
}

DaemonOptions Options(const TempDir& dir, int node) {
  DaemonOptions o;
  o.root = dir.path() + "/persistent";
  o.socket = dir.path() + "/node" + std::to_string(node) + "/ckptd.sock";
  o.chunk_mib = 1;  // items cross chunk boundaries: block checksums span the writers' ranges
  return o;
}

// Registration must fail with INVALID_ARGUMENT, saying `says`.
void CheckRefused(Client& client, const std::vector<TensorItem>& items, const std::string& says) {
  INFO(says);
  try {
    client.register_items("refused", 0, 2, items);
    FAIL("registration was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == 3);  // INVALID_ARGUMENT
    CHECK_THAT(std::string(e.what()), Contains(says));
  }
}

}  // namespace

TEST_CASE("4 ranks with layouts on 2 daemons commit format-3 shards and an index.json", "[layout][service]") {
  TempDir dir("layouts");
  DaemonProcess a(Options(dir, 0));
  DaemonProcess b(Options(dir, 1));
  const std::string job = "sharded", root = a.root();
  std::vector<std::unique_ptr<ShardedRank>> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    ranks.push_back(std::make_unique<ShardedRank>(r));
    ranks.back()->client = std::make_unique<Client>(Client::connect(r < 2 ? a.socket() : b.socket()));
    ranks.back()->client->register_items(job, r, kWorld, ranks.back()->Items());
  }
  const std::uint64_t v = 7;
  for (auto& r : ranks) {
    r->Fill(v);
    std::vector<Blob> blobs = {{"rng", "rng of " + std::to_string(r->rank), std::nullopt, 0}};
    if (r->rank == 0) blobs.push_back({"sampler", "for rank 2", 2u, 0});
    r->client->snapshot(v, blobs);
  }
  for (auto& r : ranks) r->client->wait_durable(v);
  const std::string vdir = root + "/" + job + "/" + VersionDirName(v);
  REQUIRE(fs::exists(vdir + "/COMMITTED"));

  // The index, field by field.
  auto index = VersionIndex::Parse(ReadFile(vdir + "/index.json"));
  INFO(index.status().message());
  REQUIRE(index.ok());
  CHECK(index->job == job);
  CHECK(index->version == v);
  CHECK(index->world_size == kWorld);
  REQUIRE(index->tensors.size() == 3);
  const IndexTensor& w = index->tensors.at("w");
  CHECK(w.dtype == DType::kF32);
  CHECK(w.shape == std::vector<std::int64_t>{4, 6});
  CHECK_FALSE(w.replicated);
  REQUIRE(w.chunks.size() == kWorld);
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    CHECK(w.chunks[r] == IndexChunk{r, ShardFileName(r), "w", ranks[r]->pieces[0].offsets, {2, 3}});
  }
  const IndexTensor& emb = index->tensors.at("emb");
  CHECK(emb.shape == std::vector<std::int64_t>{8, kEmbCols});
  REQUIRE(emb.chunks.size() == kWorld);
  CHECK(emb.chunks[3] == IndexChunk{3, ShardFileName(3), "emb.part", {6, 0}, {2, kEmbCols}});
  const IndexTensor& norm = index->tensors.at("norm");
  CHECK(norm.replicated);
  CHECK(norm.shape == std::vector<std::int64_t>{16});
  CHECK(norm.chunks.size() == kWorld);
  REQUIRE(index->private_items.size() == kWorld);
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    CHECK(index->private_items.at(r) ==
          std::vector<IndexItem>{{"step", ShardFileName(r), "step", DType::kI64, {1}}});
  }
  REQUIRE(index->blobs.size() == kWorld + 1);
  CHECK(index->blobs[0] == IndexBlob{0, "rng", ShardFileName(0), "__blob__/rng", 8, std::nullopt});
  CHECK(index->blobs[1] == IndexBlob{0, "sampler", ShardFileName(0), "__blob__/sampler", 10, 2});
  CHECK(index->blobs[4].rank == 3);

  // The shards: format 3, layouts and block checksums of what the bytes are.
  std::map<std::string, std::vector<float>> assembled;
  for (const auto& [name, t] : index->tensors) {
    std::uint64_t n = 1;
    for (auto d : t.shape) n *= d;
    assembled[name].assign(n, -1.0f);
  }
  for (std::uint32_t r = 0; r < kWorld; ++r) {
    const std::string path = ShardPath(root, job, v, r);
    INFO(path);
    REQUIRE(VerifyShard(path).ok());
    auto info = ReadShardHeader(path);
    REQUIRE(info.ok());
    CHECK(info->format_version == "3");
    for (const ShardItem& item : info->items) {
      INFO(item.name);
      const std::string bytes = ReadRange(path, info->data_start + item.offset, item.length);
      if (item.name == "emb.part" || item.name == "w") {
        REQUIRE(item.layout.has_value());
        CHECK(item.blocks.block_bytes == kBlockBytes);
        CHECK(item.blocks.sums == ComputeBlockSums(bytes.data(), bytes.size(), kBlockBytes));
        CHECK(VerifyBlocks(item.blocks, item.length, 0, bytes.data(), bytes.size(), item.name).ok());
      } else {
        CHECK(item.blocks.block_bytes == 0);  // replicated, private, blobs: the item checksum serves
      }
      if (item.name == "emb.part") CHECK(item.blocks.sums.size() == 2);  // 1.2 MB
      if (item.name == "norm") CHECK(item.layout->replicated);
      if (item.name == "step") CHECK_FALSE(item.layout.has_value());
      if (item.name == "sampler") CHECK(item.for_rank == 2u);
      if (item.name == "rng") CHECK_FALSE(item.for_rank.has_value());
    }
    // Every chunk of this rank into its place in the global tensor.
    for (const auto& [name, t] : index->tensors) {
      for (const IndexChunk& c : t.chunks) {
        if (c.rank != r) continue;
        auto it = std::find_if(info->items.begin(), info->items.end(),
                               [&](const ShardItem& i) { return i.TensorKey() == c.key; });
        REQUIRE(it != info->items.end());
        const std::string bytes = ReadRange(path, info->data_start + it->offset, it->length);
        const float* src = reinterpret_cast<const float*>(bytes.data());
        std::vector<std::int64_t> idx(c.shape.size(), 0);
        for (std::uint64_t i = 0; i * 4 < bytes.size(); ++i) {
          std::vector<std::int64_t> g(idx.size());
          for (std::size_t d = 0; d < idx.size(); ++d) g[d] = c.offsets[d] + idx[d];
          assembled[name][Flat(t.shape, g)] = src[i];
          for (std::size_t d = idx.size(); d-- > 0;) {
            if (++idx[d] < c.shape[d]) break;
            idx[d] = 0;
          }
        }
      }
    }
  }
  for (const auto& [name, values] : assembled) {
    INFO(name);
    std::uint64_t wrong = 0;
    for (std::uint64_t i = 0; i < values.size(); ++i) wrong += values[i] != GlobalValue(name, i, v);
    CHECK(wrong == 0);
  }

  // The real safetensors package opens every shard and reads the layout metadata.
  const std::string pydeps = std::string(CKPT_SOURCE_DIR) + "/build/pydeps";
  const std::string script =
      "import sys, json\n"
      "from safetensors import safe_open\n"
      "for path in sys.argv[1:]:\n"
      "    with safe_open(path, framework='np') as f:\n"
      "        md = f.metadata()\n"
      "        assert md['ckpt.format_version'] == '3', md['ckpt.format_version']\n"
      "        lay = json.loads(md['ckpt.layout.emb.part'])\n"
      "        t = f.get_tensor('emb.part')\n"
      "        assert list(t.shape) == [2, 150000] and lay['global'] == 'emb' and lay['shape'] == [8, "
      "150000]\n"
      "        assert json.loads(md['ckpt.layout.norm']) == {'global': 'norm', 'replicated': True}\n"
      "        assert f.get_tensor('w').shape == (2, 3) and f.get_tensor('step').dtype.name == 'int64'\n"
      "print('ok')\n";
  std::vector<std::string> argv = {"/usr/bin/env", "PYTHONPATH=" + pydeps, "/usr/bin/python3", "-c", script};
  for (std::uint32_t r = 0; r < kWorld; ++r) argv.push_back(ShardPath(root, job, v, r));
  ProcessResult py = RunProcess(argv);
  INFO(py.output);
  if (py.output.find("No module named 'safetensors'") != std::string::npos) {
    WARN("safetensors is not installed in " + pydeps +
         " (pip install --target build/pydeps safetensors): skipped");
  } else {
    CHECK(py.exit_code == 0);
    CHECK_THAT(py.output, Contains("ok"));
  }

  // ckptctl still lists, inspects and verifies format-3 shards.
  ProcessResult ls = RunProcess({CKPTCTL_BINARY, "ls", "--job", job, "--socket", a.socket()});
  INFO(ls.output);
  CHECK(ls.exit_code == 0);
  CHECK_THAT(ls.output, Contains("7"));
  ProcessResult inspect = RunProcess({CKPTCTL_BINARY, "inspect", ShardPath(root, job, v, 1), "--json"});
  INFO(inspect.output);
  CHECK(inspect.exit_code == 0);
  CHECK_THAT(inspect.output, Contains("\"3\""));
  ProcessResult verify = RunProcess({CKPTCTL_BINARY, "verify", "--root", root, "--job", job});
  INFO(verify.output);
  CHECK(verify.exit_code == 0);
}

TEST_CASE("a version without layouts gets an index of private items and stays format 2",
          "[layout][service]") {
  TempDir dir("plainidx");
  DaemonProcess d(Options(dir, 0));
  auto region = SharedRegion::create(64);
  Client c = Client::connect(d.socket());
  c.register_items("plain", 0, 1, {{"x", DType::kF32, {16}, region, 0}});
  c.snapshot(1, {{"rng", "abc"}});
  c.wait_durable(1);
  auto info = ReadShardHeader(ShardPath(d.root(), "plain", 1, 0));
  REQUIRE(info.ok());
  CHECK(info->format_version == "2");
  auto index = VersionIndex::Parse(ReadFile(d.root() + "/plain/" + VersionDirName(1) + "/index.json"));
  REQUIRE(index.ok());
  CHECK(index->tensors.empty());
  CHECK(index->private_items.at(0) ==
        std::vector<IndexItem>{{"x", ShardFileName(0), "x", DType::kF32, {16}}});
  REQUIRE(index->blobs.size() == 1);
  CHECK(index->blobs[0].bytes == 3);
}

TEST_CASE("register_items refuses a bad layout with INVALID_ARGUMENT naming the item", "[layout][service]") {
  TempDir dir("badlayout");
  DaemonProcess d(Options(dir, 0));
  auto region = SharedRegion::create(4096);
  Client c = Client::connect(d.socket());
  auto item = [&](std::string name, Layout l) {
    return TensorItem{std::move(name), DType::kF32, {2, 3}, region, 0, nullptr, std::move(l)};
  };
  CheckRefused(c, {item("w.a", Layout{"g", {4, 6}, {0}, false})},
               "'w.a': layout has global shape [4,6] and offsets [0]");
  CheckRefused(c, {item("w.b", Layout{"g", {4}, {0, 0}, false})}, "'w.b': layout has global shape [4]");
  CheckRefused(c, {item("w.c", Layout{"g", {4, 6}, {-1, 0}, false})}, "'w.c': layout has a negative");
  CheckRefused(
      c, {item("w.d", Layout{"g", {4, 6}, {3, 0}, false})},
      "'w.d': layout box offsets [3,0] + shape [2,3] does not fit the global shape [4,6] in dimension 0");
  CheckRefused(c, {item("w.e", Layout{"g", {4, -6}, {0, 0}, false})}, "'w.e': layout has a negative");
  CheckRefused(c, {item("w.f", Layout{"bad/name", {4, 6}, {0, 0}, false})}, "'w.f': layout global name");
  CheckRefused(c, {item("w.g", Layout{"", {4, 4}, {}, true})},
               "'w.g': layout is replicated but its global shape");
  CheckRefused(c, {item("w.h", Layout{"", {}, {1, 0}, true})}, "'w.h': layout is replicated but has offsets");
  // The registration is refused whole: a good item next to a bad one does not register.
  CheckRefused(
      c, {item("ok", Layout{"g", {4, 6}, {0, 0}, false}), item("w.i", Layout{"g", {4, 6}, {0, 4}, false})},
      "'w.i'");
  // The client sends one layout per item; a table item without it stays private, and a
  // refused registration leaves none behind: the next one registers.
  auto reg = c.register_items("refused", 0, 2, {item("fine", Layout{"g", {4, 6}, {2, 3}, false})});
  CHECK(reg.item_count == 1);
  // A blob for a rank outside the world size.
  try {
    c.snapshot(1, {{"rng", "x", 2u, 0}});
    FAIL("snapshot was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == 3);
    CHECK_THAT(std::string(e.what()),
               Contains("blob 'rng' is for rank 2, which is not a rank of world size 2"));
  }
}

TEST_CASE("layouts naming no tensor item, or one item twice, are refused by the daemon",
          "[layout][service]") {
  TempDir dir("rawlayout");
  DaemonProcess d(Options(dir, 0));
  // The client library sends one layout per item of its own: the daemon checks a raw request.
  auto region = SharedRegion::create(4096);
  auto table = DescriptorTable::Create("", 4);
  REQUIRE(table.ok());
  TableItem row;
  row.name = "y";
  row.dtype = DType::kF32;
  row.shape = {4};
  row.region = region->name();
  row.length = 16;
  row.generation = region->generation();
  REQUIRE(table->Write({row}).ok());
  auto stub = d.Stub();
  auto attempt = [&](const std::vector<std::string>& layout_items) {
    v1::RegisterRequest req;
    req.set_job("raw");
    req.set_rank(0);
    req.set_world_size(1);
    req.set_descriptor_table(table->name());
    for (const auto& item : layout_items) {
      v1::ItemLayout* l = req.add_layouts();
      l->set_item(item);
      l->set_replicated(true);
    }
    grpc::ClientContext ctx;
    v1::RegisterReply rep;
    return stub->Register(&ctx, req, &rep);
  };
  grpc::Status none = attempt({"rng"});
  CHECK(none.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(none.error_message(),
             Contains("layout for item 'rng', which is no tensor item of the registration"));
  grpc::Status twice = attempt({"y", "y"});
  CHECK(twice.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(twice.error_message(), Contains("item 'y' has two layouts"));
  CHECK(attempt({"y"}).ok());
}

TEST_CASE("ranks that disagree on a global tensor fail the commit, naming it", "[layout][service]") {
  TempDir dir("conflict");
  DaemonProcess d(Options(dir, 0));
  std::vector<std::shared_ptr<SharedRegion>> regions;
  std::vector<std::unique_ptr<Client>> clients;
  for (std::uint32_t r = 0; r < 2; ++r) {
    regions.push_back(SharedRegion::create(4096));
    clients.push_back(std::make_unique<Client>(Client::connect(d.socket())));
    // Rank 1 declares a global shape of [4, 3], rank 0 of [4, 6].
    Layout l{"g", {4, std::int64_t(r == 0 ? 6 : 3)}, {2 * std::int64_t(r), 0}, false};
    clients[r]->register_items("conflict", r, 2, {{"w", DType::kF32, {2, 3}, regions[r], 0, nullptr, l}});
  }
  for (auto& c : clients) c->snapshot(1);
  for (auto& c : clients) {
    try {
      c->wait_durable(1, Level::kCommitted, std::chrono::seconds(60));
      FAIL("the version committed");
    } catch (const Error& e) {
      CHECK_THAT(std::string(e.what()),
                 Contains("commit") && Contains("global tensor 'g' is declared as F32 [4, 6] by rank 0"));
    }
  }
  CHECK_FALSE(fs::exists(d.root() + "/conflict/" + VersionDirName(1) + "/COMMITTED"));
}

TEST_CASE("ItemHasher gives block checksums with the item checksums, whatever the ranges",
          "[hasher][layout]") {
  // Items with 4 KiB blocks (lengths around block and range boundaries) between items without.
  struct Spec {
    std::uint64_t length;
    bool blocks;
  };
  const std::vector<Spec> specs = {{0, true},     {5000, true}, {1, true},    {70000, false}, {70000, true},
                                   {12345, true}, {3, false},   {8192, true}, {4096, true}};
  std::vector<ShardItem> items;
  std::string data;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ShardItem it;
    it.name = "i" + std::to_string(i);
    it.length = specs[i].length;
    it.offset = data.size();
    if (specs[i].blocks) {
      it.blocks.block_bytes = kMinBlockBytes;
      it.blocks.sums.resize(BlockCount(it.length, kMinBlockBytes));
    }
    data += Bytes(it.length, 40 + static_cast<std::uint32_t>(i));
    items.push_back(it);
  }
  for (std::uint64_t range : {std::uint64_t{1000}, std::uint64_t{3000}, std::uint64_t{4096},
                              std::uint64_t{65536}, std::uint64_t{1} << 20}) {
    for (unsigned threads : {1u, 4u}) {
      INFO("range " << range << ", " << threads << " threads");
      for (auto& it : items) std::fill(it.blocks.sums.begin(), it.blocks.sums.end(), 0);
      ItemHasher hasher(items);
      std::mutex mu;
      std::uint64_t next = 0;
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
            hasher.Hash(off, data.data() + off, std::min<std::uint64_t>(range, data.size() - off));
          }
        });
      }
      for (auto& t : pool) t.join();
      for (const auto& it : items) {
        INFO(it.name);
        const char* bytes = data.data() + it.offset;
        CHECK(it.checksum == Checksum::Of(bytes, it.length));
        if (it.blocks.block_bytes != 0)
          CHECK(it.blocks.sums == ComputeBlockSums(bytes, it.length, kMinBlockBytes));
      }
    }
  }
}
