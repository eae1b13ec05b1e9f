// Restore at another world size (issue 16), with real ckptd processes: a job saved by 4 ranks
// (N-d boxes: a 2-D tensor split 2x2, a row split, a column split, a 3-D tensor, a tensor of
// several 1 MiB blocks per chunk, a replicated item, blobs for every rank and for one) is
// restored by 2, 3 and 8 ranks with other decompositions, and every byte is checked against
// the global tensors; a corrupted block, a rank-private item and a gap in coverage get errors
// that name them, with nothing written; the job then goes on at the new world size.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "format/dtype.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

struct Global {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  // Parts per dimension when saved by 4 ranks.
  std::vector<std::int64_t> saved_parts;
};

const std::vector<Global>& Globals() {
  static const std::vector<Global> g = {
      {"w", DType::kF32, {8, 12}, {2, 2}},        {"rows", DType::kF32, {16, 5}, {4, 1}},
      {"cols", DType::kF64, {6, 16}, {1, 4}},     {"cube", DType::kI16, {4, 6, 8}, {2, 1, 2}},
      {"big", DType::kF32, {2048, 1024}, {2, 2}},  // 2 MiB chunks: 2 blocks each
  };
  return g;
}

// Parts per dimension of each global tensor when restored by n ranks.
std::vector<std::int64_t> Parts(const std::string& name, std::uint32_t n) {
  static const std::map<std::uint32_t, std::map<std::string, std::vector<std::int64_t>>> parts = {
      {2, {{"w", {2, 1}}, {"rows", {1, 2}}, {"cols", {2, 1}}, {"cube", {1, 2, 1}}, {"big", {2, 1}}}},
      {3, {{"w", {1, 3}}, {"rows", {3, 1}}, {"cols", {3, 1}}, {"cube", {1, 3, 1}}, {"big", {3, 1}}}},
      {4, {{"w", {1, 4}}, {"rows", {2, 2}}, {"cols", {2, 2}}, {"cube", {4, 1, 1}}, {"big", {1, 4}}}},
      {8, {{"w", {2, 4}}, {"rows", {8, 1}}, {"cols", {1, 8}}, {"cube", {2, 2, 2}}, {"big", {1, 8}}}},
  };
  return parts.at(n).at(name);
}

// The box of rank r when `shape` is cut into `parts` per dimension (near-equal, uneven
// sizes allowed), ranks in row-major order over the parts.
struct Cut {
  std::vector<std::int64_t> offsets, shape;
};
Cut BoxOf(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& parts, std::uint32_t r) {
  Cut c;
  std::vector<std::int64_t> idx(shape.size());
  std::int64_t rest = r;
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = rest % parts[d];
    rest /= parts[d];
  }
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const std::int64_t lo = idx[d] * shape[d] / parts[d], hi = (idx[d] + 1) * shape[d] / parts[d];
    c.offsets.push_back(lo);
    c.shape.push_back(hi - lo);
  }
  return c;
}

std::uint64_t Elements(const std::vector<std::int64_t>& shape) {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

// The global tensors' bytes (a seeded pattern, different per tensor).
const std::vector<char>& GlobalBytes(const Global& g) {
  static std::map<std::string, std::vector<char>> bytes;
  auto& b = bytes[g.name];
  if (b.empty()) {
    b.resize(Elements(g.shape) * DTypeSize(g.dtype));
    std::mt19937_64 rng(std::hash<std::string>()(g.name));
    for (auto& c : b) c = static_cast<char>(rng());
  }
  return b;
}

// The bytes of `cut` of a global tensor, element by element.
std::vector<char> Extract(const Global& g, const Cut& cut) {
  const std::vector<char>& src = GlobalBytes(g);
  const std::size_t elem = DTypeSize(g.dtype), n = g.shape.size();
  std::vector<char> out(Elements(cut.shape) * elem);
  std::vector<std::int64_t> at(n, 0);  // within the cut
  for (std::uint64_t k = 0; k < Elements(cut.shape); ++k) {
    std::uint64_t gi = 0;
    for (std::size_t d = 0; d < n; ++d) gi = gi * g.shape[d] + (cut.offsets[d] + at[d]);
    std::memcpy(out.data() + k * elem, src.data() + gi * elem, elem);
    for (std::size_t d = n; d-- > 0;) {
      if (++at[d] < cut.shape[d]) break;
      at[d] = 0;
    }
  }
  return out;
}

std::string Replicated() { return std::string(40, 'r') + "replicated state"; }

// One rank of a trainer: a region holding its items, packed.
struct RankState {
  std::shared_ptr<SharedRegion> region;
  std::vector<TensorItem> items;
  std::vector<std::vector<char>> want;  // per item, the bytes it must hold after a restore
  Client client;

  RankState(const std::string& socket) : client(Client::connect(socket)) {}
  // Fills every item with `byte`.
  void Poison(char byte) { std::memset(region->data(), byte, region->size()); }
  const char* Bytes(std::size_t i) const {
    return static_cast<const char*>(region->data()) + items[i].offset;
  }
  // The first item whose bytes differ from `want`, or "".
  std::string FirstMismatch() const {
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (std::memcmp(Bytes(i), want[i].data(), want[i].size()) != 0) return items[i].name;
    }
    return "";
  }
};

// Rank r of n with the global tensors cut by `parts`, the replicated item, and (when
// `with_private`) a rank-private item "step"; filled with what it must hold.
std::unique_ptr<RankState> MakeRank(const std::string& socket, std::uint32_t r, std::uint32_t n,
                                    const std::function<std::vector<std::int64_t>(const Global&)>& parts,
                                    bool with_private = false) {
  auto s = std::make_unique<RankState>(socket);
  std::vector<std::pair<TensorItem, std::vector<char>>> items;
  for (const Global& g : Globals()) {
    const Cut cut = BoxOf(g.shape, parts(g), r);
    TensorItem it;
    it.name = g.name;
    it.dtype = g.dtype;
    it.shape = cut.shape;
    Layout l;
    l.global_shape = g.shape;
    l.offsets = cut.offsets;
    it.layout = l;
    items.emplace_back(std::move(it), Extract(g, cut));
  }
  TensorItem rep;
  rep.name = "rep";
  rep.dtype = DType::kU8;
  rep.shape = {static_cast<std::int64_t>(Replicated().size())};
  Layout rl;
  rl.replicated = true;
  rep.layout = rl;
  const std::string replicated = Replicated();
  items.emplace_back(rep, std::vector<char>(replicated.begin(), replicated.end()));
  if (with_private) {
    TensorItem step;
    step.name = "step";
    step.dtype = DType::kI64;
    step.shape = {1};
    std::vector<char> v(8, 0);
    v[0] = static_cast<char>(10 + r);
    items.emplace_back(step, v);
  }
  std::size_t bytes = 0;
  for (auto& [it, b] : items) {
    it.offset = bytes;
    bytes += (b.size() + 63) / 64 * 64;
  }
  s->region = SharedRegion::create(bytes);
  for (auto& [it, b] : items) {
    it.region = s->region;
    std::memcpy(static_cast<char*>(s->region->data()) + it.offset, b.data(), b.size());
    s->items.push_back(it);
    s->want.push_back(b);
  }
  s->client.register_items("job", r, n, s->items);
  return s;
}

auto SavedParts = [](const Global& g) { return g.saved_parts; };
auto PartsFor(std::uint32_t n) {
  return [n](const Global& g) { return Parts(g.name, n); };
}

std::vector<Blob> BlobsOf(std::uint32_t r) {
  Blob common{"common", "common state of rank " + std::to_string(r)};
  Blob mine{"mine", "state meant for rank " + std::to_string(r)};
  mine.for_rank = r;
  return {common, mine};
}

// Saves version `v` from 4 ranks (the saved decomposition), committed.
void SaveAt4(const std::string& socket, std::uint64_t v, bool with_private = false) {
  std::vector<std::unique_ptr<RankState>> ranks;
  for (std::uint32_t r = 0; r < 4; ++r) ranks.push_back(MakeRank(socket, r, 4, SavedParts, with_private));
  for (std::uint32_t r = 0; r < 4; ++r) ranks[r]->client.snapshot(v, BlobsOf(r));
  for (auto& rank : ranks) rank->client.wait_durable(v, Level::kCommitted);
  for (auto& rank : ranks) rank->client.unregister();
}

DaemonOptions Options(const TempDir& dir, std::vector<std::string> extra = {}) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = std::move(extra);
  return o;
}

// Restores every rank of n (poisoned first) and checks each byte and the blobs.
void RestoreAndCheck(const std::string& socket, std::uint32_t n, std::uint64_t version, bool resharded,
                     std::uint32_t written_by, const std::string& tier = "") {
  for (std::uint32_t r = 0; r < n; ++r) {
    INFO("rank " << r << " of " << n);
    auto rank = MakeRank(socket, r, n, PartsFor(n));
    rank->Poison('\x77');
    RestoreResult res = rank->client.restore(version);
    CHECK(res.version == version);
    CHECK(res.resharded == resharded);
    CHECK(res.world_size == written_by);
    if (!tier.empty()) CHECK(res.tier == tier);
    CHECK(rank->FirstMismatch() == "");
    // Blobs: "common" of every rank that wrote one, "mine" only from this rank.
    std::map<std::string, std::vector<std::pair<std::uint32_t, std::string>>> got;
    for (const Blob& b : res.blobs) got[b.name].emplace_back(b.from_rank, b.data);
    if (resharded) {
      REQUIRE(got["common"].size() == written_by);
      for (std::uint32_t w = 0; w < written_by; ++w) {
        CHECK(got["common"][w] == std::make_pair(w, "common state of rank " + std::to_string(w)));
      }
    }
    if (r < written_by) {
      REQUIRE(got["mine"].size() == 1);
      CHECK(got["mine"][0] == std::make_pair(r, "state meant for rank " + std::to_string(r)));
    } else {
      CHECK(got["mine"].empty());
    }
    rank->client.unregister();
  }
}

}  // namespace

TEST_CASE(
    "a version saved by 4 ranks restores into 2 and 3 and 8 ranks with N-d boxes and every byte checked",
    "[elastic]") {
  TempDir dir("elastic");
  DaemonProcess daemon(Options(dir));
  SaveAt4(daemon.socket(), 1);
  // The memory tier holds every rank's shard: every piece comes from there.
  RestoreAndCheck(daemon.socket(), 2, 1, true, 4, "memory");
  RestoreAndCheck(daemon.socket(), 3, 1, true, 4, "memory");
  RestoreAndCheck(daemon.socket(), 8, 1, true, 4, "memory");
  // The same world size with another decomposition is resharded too.
  RestoreAndCheck(daemon.socket(), 4, 1, true, 4);
  // The same decomposition takes the fast path: own blobs only.
  auto same = MakeRank(daemon.socket(), 1, 4, SavedParts);
  same->Poison('\x11');
  RestoreResult r = same->client.restore();
  CHECK_FALSE(r.resharded);
  CHECK(r.world_size == 4);
  CHECK(same->FirstMismatch() == "");
  REQUIRE(r.blobs.size() == 2);
  CHECK(r.blobs[0].from_rank == 1);
  same->client.unregister();
  // Counted in the metrics.
  std::string status = Client::connect(daemon.socket()).status().json;
  status.erase(std::remove(status.begin(), status.end(), ' '), status.end());
  INFO(status);
  CHECK(status.find("\"restores_resharded\":\"17\"") != std::string::npos);
}

TEST_CASE("a restore at another world size reads the persistent tier after a daemon restart", "[elastic]") {
  TempDir dir("elastic-persist");
  {
    DaemonProcess daemon(Options(dir));
    SaveAt4(daemon.socket(), 1);
  }
  DaemonProcess daemon(Options(dir));  // the memory tier is empty now
  RestoreAndCheck(daemon.socket(), 2, 1, true, 4, "persistent");
  RestoreAndCheck(daemon.socket(), 3, 1, true, 4, "persistent");
}

TEST_CASE("a differential version restores at another world size, its unchanged items read from its base",
          "[elastic][differential]") {
  TempDir dir("elastic-diff");
  auto options = [&](const std::string& local) {
    return Options(dir, {"--local", dir.path() + "/" + local, "--persistent-base-every", "4"});
  };
  {
    DaemonProcess daemon(options("local"));
    SaveAt4(daemon.socket(), 1);
    SaveAt4(daemon.socket(), 2);  // the same state: every item of version 2 is version 1's
  }
  for (std::uint32_t r = 0; r < 4; ++r) {
    auto info = ReadShardHeader(dir.path() + "/root/job/" + VersionDirName(2) + "/" + ShardFileName(r));
    REQUIRE(info.ok());
    CHECK(info->base == std::optional<std::uint64_t>(1));
  }
  DaemonProcess daemon(options("local2"));  // nothing in memory nor on the local tier
  RestoreAndCheck(daemon.socket(), 2, 2, true, 4, "persistent");
  RestoreAndCheck(daemon.socket(), 3, 2, true, 4, "persistent");
}

TEST_CASE("a corrupted block of a persistent shard is reported by name and nothing is written", "[elastic]") {
  TempDir dir("elastic-corrupt");
  DaemonProcess daemon(Options(dir, {"--memory-mib", "0"}));
  SaveAt4(daemon.socket(), 1);
  // "big" is 2048 x 1024 F32 in 2x2 chunks of 1024 x 512 (2 MiB, 2 blocks): flip a byte in
  // block 1 of rank 0's chunk (its rows 512..1023).
  const std::string shard = dir.path() + "/root/job/" + VersionDirName(1) + "/" + ShardFileName(0);
  auto info = ReadShardHeader(shard);
  REQUIRE(info.ok());
  std::uint64_t at = 0;
  for (const auto& it : info->items) {
    if (it.name == "big") at = info->data_start + it.offset + (1u << 20) + 4096;
  }
  REQUIRE(at != 0);
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&c, 1);
    REQUIRE(f.good());
  }
  // At 2 ranks, rows split: rank 0 (rows 0..1023) needs that block.
  auto r0 = MakeRank(daemon.socket(), 0, 2, PartsFor(2));
  r0->Poison('\x33');
  try {
    r0->client.restore();
    FAIL("restore of a corrupted piece succeeded");
  } catch (const Error& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::DATA_LOSS));
    CHECK(m.find("global tensor 'big'") != std::string::npos);
    CHECK(m.find("block 1") != std::string::npos);
    CHECK(m.find(shard) != std::string::npos);
    CHECK(m.find("rank 0") != std::string::npos);
    CHECK(m.find("nothing was written to the registered regions") != std::string::npos);
  }
  const std::string poisoned(r0->region->size(), '\x33');
  CHECK(std::memcmp(r0->region->data(), poisoned.data(), poisoned.size()) == 0);
  r0->client.unregister();
  // Rank 1 (rows 1024..2047) reads only blocks of ranks 2 and 3: verified, restored.
  auto r1 = MakeRank(daemon.socket(), 1, 2, PartsFor(2));
  r1->Poison('\x33');
  CHECK(r1->client.restore().resharded);
  CHECK(r1->FirstMismatch() == "");
}

TEST_CASE("a rank-private item at another world size is refused by name and nothing is written",
          "[elastic]") {
  TempDir dir("elastic-private");
  DaemonProcess daemon(Options(dir));
  SaveAt4(daemon.socket(), 1, /*with_private=*/true);
  auto r = MakeRank(daemon.socket(), 0, 2, PartsFor(2), /*with_private=*/true);
  r->Poison('\x44');
  try {
    r->client.restore();
    FAIL("a rank-private item restored at another world size");
  } catch (const Error& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
    CHECK(m.find("item 'step' is rank-private") != std::string::npos);
    CHECK(m.find("written by 4 ranks, not 2") != std::string::npos);
    CHECK(m.find("restore with 4 ranks") != std::string::npos);
  }
  const std::string poisoned(r->region->size(), '\x44');
  CHECK(std::memcmp(r->region->data(), poisoned.data(), poisoned.size()) == 0);
  r->client.unregister();
  // At the same world size the private item comes from its own rank, the rest resharded.
  for (std::uint32_t k = 0; k < 4; ++k) {
    auto same = MakeRank(daemon.socket(), k, 4, PartsFor(4), /*with_private=*/true);
    same->Poison('\x45');
    CHECK(same->client.restore().resharded);
    CHECK(same->FirstMismatch() == "");
    same->client.unregister();
  }
}

TEST_CASE("another global shape or dtype or a missing global tensor is refused by name", "[elastic]") {
  TempDir dir("elastic-gap");
  DaemonProcess daemon(Options(dir));
  SaveAt4(daemon.socket(), 1);
  auto expect = [&](std::vector<TensorItem> items, const std::string& text) {
    Client c = Client::connect(daemon.socket());
    auto region = SharedRegion::create(4096);
    for (auto& it : items) it.region = region;
    c.register_items("job", 0, 2, items);
    try {
      c.restore();
      FAIL("restored: " << text);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(e.code() == static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
      CHECK(std::string(e.what()).find(text) != std::string::npos);
    }
    c.unregister();
  };
  TensorItem it;
  it.name = "x";
  it.dtype = DType::kF32;
  it.shape = {2, 2};
  Layout l;
  l.global_name = "w";
  l.global_shape = {8, 12};
  l.offsets = {0, 0};
  it.layout = l;
  TensorItem other_shape = it;
  other_shape.layout->global_shape = {8, 14};
  expect({other_shape}, "global tensor 'w' of shape [8, 14], but version 1 stored it with shape [8, 12]");
  TensorItem other_dtype = it;
  other_dtype.dtype = DType::kI32;
  expect({other_dtype}, "item 'x' is registered as I32 but rank 0 of version 1 stored it as F32");
  TensorItem missing = it;
  missing.layout->global_name = "nope";
  missing.layout->global_shape = {8, 12};
  expect({missing}, "version 1 has no global tensor 'nope' (item 'x' asks for it at box [0:2, 0:2])");
  // Replicated against chunked, both ways.
  TensorItem as_replicated = it;
  as_replicated.layout = Layout{"w", {}, {}, true};
  as_replicated.shape = {8, 12};
  expect({as_replicated}, "item 'x' is registered as replicated, but global tensor 'w' is stored as chunks");
  TensorItem as_box;
  as_box.name = "x";
  as_box.dtype = DType::kU8;
  as_box.shape = {4};
  as_box.layout = Layout{"rep", {static_cast<std::int64_t>(Replicated().size())}, {0}, false};
  expect({as_box}, "item 'x' asks for box [0:4] of global tensor 'rep', which rank 0 stored as replicated");
}

TEST_CASE(
    "after a restore at 2 ranks the job goes on at 2 and versions commit and restore fast and roll back",
    "[elastic]") {
  TempDir dir("elastic-continue");
  DaemonProcess daemon(Options(dir));
  SaveAt4(daemon.socket(), 1);
  {
    std::vector<std::unique_ptr<RankState>> ranks;
    for (std::uint32_t r = 0; r < 2; ++r) {
      ranks.push_back(MakeRank(daemon.socket(), r, 2, PartsFor(2)));
      ranks[r]->Poison('\x55');
      CHECK(ranks[r]->client.restore().resharded);
      CHECK(ranks[r]->FirstMismatch() == "");
    }
    // Training goes on at world size 2: version 2 commits with 2 ranks.
    for (std::uint32_t r = 0; r < 2; ++r) ranks[r]->client.snapshot(2, BlobsOf(r));
    for (auto& rank : ranks) rank->client.wait_durable(2, Level::kCommitted);
    for (auto& rank : ranks) rank->client.unregister();
  }
  // Version 2 at 2 ranks: the fast path.
  RestoreAndCheck(daemon.socket(), 2, 2, false, 2, "memory");
  // And at 8 ranks, from the 2-rank version.
  RestoreAndCheck(daemon.socket(), 8, 2, true, 2);
  // Back to version 1 (4 ranks) with 3 ranks: a rollback, version 2 set aside; numbering
  // goes on from 1 and the 3 ranks commit version 2 again.
  std::vector<std::unique_ptr<RankState>> ranks;
  for (std::uint32_t r = 0; r < 3; ++r) {
    ranks.push_back(MakeRank(daemon.socket(), r, 3, PartsFor(3)));
    RestoreResult res = ranks[r]->client.restore(1);
    CHECK(res.resharded);
    CHECK(res.world_size == 4);
    CHECK(ranks[r]->FirstMismatch() == "");
  }
  CHECK(fs::exists(dir.path() + "/root/job/set-aside"));
  for (std::uint32_t r = 0; r < 3; ++r) ranks[r]->client.snapshot(2, BlobsOf(r));
  for (auto& rank : ranks) rank->client.wait_durable(2, Level::kCommitted);
  for (auto& rank : ranks) rank->client.unregister();
  RestoreAndCheck(daemon.socket(), 3, 2, false, 3);
}
