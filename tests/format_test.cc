// The shard file format, checksums, tree names and name validation, without a daemon.
//
// Shards here are written by hand (RenderHeader + data) so that the reader is tested
// against bytes the test controls, including corrupted, truncated and malformed ones.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/names.h"
#include "format/checksum.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "support/byte_pattern.h"
#include "support/shard_items.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::Bytes;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;

namespace {

ShardMeta Meta() { return ShardMeta{"job-1", 42, 3, 8, ""}; }

ShardItem Tensor(std::string name, DType dtype, std::vector<std::int64_t> shape) {
  return test::TensorItem(std::move(name), dtype, std::move(shape));
}
ShardItem Blob(std::string name, std::uint64_t bytes) { return test::BlobItem(std::move(name), bytes); }

std::vector<ShardItem> SampleItems() {
  return {Tensor("layers.0.attn.weight", DType::kF32, {16, 8}),
          Tensor("layers.0.attn.bias", DType::kBF16, {7}), Tensor("empty", DType::kF16, {0, 4}),
          Tensor("scalar", DType::kI64, {}), Blob("rng_state", 33)};
}

struct HandShard {
  ShardLayout layout;
  std::vector<std::string> data;  // bytes of each item, in plan order
  std::string path;
};

// Plans `items`, fills each with deterministic bytes, sets the checksums and writes the
// file as the flush engine would: rendered header, then the packed data.
HandShard WriteShard(const std::string& path, std::vector<ShardItem> items, ShardMeta meta = Meta()) {
  auto planned = ShardLayout::Plan(meta, std::move(items));
  REQUIRE(planned.ok());
  HandShard shard{std::move(planned).value(), {}, path};
  std::string file = shard.layout.RenderHeader();
  std::uint32_t seed = 1;
  for (auto& item : shard.layout.items()) {
    std::string bytes = Bytes(item.length, seed++);
    item.checksum = Checksum::Of(bytes.data(), bytes.size());
    shard.data.push_back(bytes);
  }
  std::string header = shard.layout.RenderHeader();
  REQUIRE(header.size() == file.size());
  file = header;
  for (const auto& d : shard.data) file += d;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(file.data(), static_cast<std::streamsize>(file.size()));
  out.close();
  REQUIRE(out.good());
  return shard;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  REQUIRE(out.good());
}

std::uint64_t LittleEndian64(const std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return n;
}

std::string Prefix(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A well-formed header of our format with two U8 tensors at the given offsets. Tests
// bend one field at a time and expect ParseShardHeader to notice.
nlohmann::ordered_json TwoItemHeader(std::uint64_t a_begin, std::uint64_t a_end, std::uint64_t b_begin,
                                     std::uint64_t b_end) {
  nlohmann::ordered_json h;
  h["__metadata__"] = {{"ckpt.format_version", "1"},
                       {"ckpt.job", "j"},
                       {"ckpt.version", "1"},
                       {"ckpt.rank", "0"},
                       {"ckpt.world_size", "1"},
                       {"ckpt.item.a", "kind=tensor xxh3=0000000000000000"},
                       {"ckpt.item.b", "kind=tensor xxh3=0000000000000000"}};
  h["a"] = {{"dtype", "U8"}, {"shape", {a_end - a_begin}}, {"data_offsets", {a_begin, a_end}}};
  h["b"] = {{"dtype", "U8"}, {"shape", {b_end - b_begin}}, {"data_offsets", {b_begin, b_end}}};
  return h;
}

Result<ShardInfo> Parse(const nlohmann::ordered_json& h, std::uint64_t data_bytes) {
  std::string text = h.dump();
  return ParseShardHeader(text, 8 + text.size() + data_bytes);
}

}  // namespace

TEST_CASE("Plan packs items in order and aligns the data section to 4 KiB", "[format]") {
  auto layout = ShardLayout::Plan(Meta(), SampleItems());
  REQUIRE(layout.ok());
  const auto& items = layout->items();
  REQUIRE(items.size() == 5);
  std::uint64_t expect = 0;
  for (const auto& item : items) {
    INFO(item.name);
    CHECK(item.offset == expect);
    expect += item.length;
  }
  CHECK(items[0].length == 16 * 8 * 4);
  CHECK(items[1].length == 14);
  CHECK(items[2].length == 0);
  CHECK(items[3].length == 8);
  CHECK(items[4].length == 33);
  CHECK(layout->data_bytes() == expect);
  CHECK(layout->header_bytes() % kDataAlignment == 0);
  CHECK(layout->header_bytes() >= kDataAlignment);
  CHECK(layout->file_bytes() == layout->header_bytes() + layout->data_bytes());
  CHECK(layout->meta().job == "job-1");
  CHECK(layout->meta().version == 42);
}

TEST_CASE("Plan sizes a header larger than one block to a whole number of blocks", "[format]") {
  std::vector<ShardItem> items;
  for (int i = 0; i < 300; ++i) {
    items.push_back(
        Tensor("model.layers." + std::to_string(i) + ".mlp.down_proj.weight", DType::kBF16, {3, 5}));
  }
  auto layout = ShardLayout::Plan(Meta(), items);
  REQUIRE(layout.ok());
  CHECK(layout->header_bytes() > kDataAlignment);
  CHECK(layout->header_bytes() % kDataAlignment == 0);
  CHECK(layout->items().back().offset == 299u * 30);
  CHECK(layout->data_bytes() == 300u * 30);
  // The rendered JSON fits, with at most one block of padding.
  std::string header = layout->RenderHeader();
  std::string json = header.substr(8);
  std::size_t end = json.find_last_not_of(' ');
  REQUIRE(end != std::string::npos);
  CHECK(8 + end + 1 > layout->header_bytes() - kDataAlignment);
}

TEST_CASE("RenderHeader has the planned size before and after checksums are set", "[format]") {
  auto layout = ShardLayout::Plan(Meta(), SampleItems());
  REQUIRE(layout.ok());
  std::string before = layout->RenderHeader();
  REQUIRE(before.size() == layout->header_bytes());
  for (auto& item : layout->items()) item.checksum = 0xffffffffffffffffull;
  std::string after = layout->RenderHeader();
  REQUIRE(after.size() == layout->header_bytes());
  CHECK(after != before);
  for (auto& item : layout->items()) item.checksum = 0x0123456789abcdefull;
  std::string mixed = layout->RenderHeader();
  CHECK(mixed.size() == before.size());

  // The prefix counts the rest of the header; the JSON starts right after it and the
  // padding is spaces (valid JSON whitespace for safetensors readers).
  CHECK(LittleEndian64(after) == layout->header_bytes() - 8);
  CHECK(after[8] == '{');
  std::string json = after.substr(8);
  std::size_t close = json.find_last_not_of(' ');
  REQUIRE(close != std::string::npos);
  CHECK(json[close] == '}');
  auto parsed = nlohmann::json::parse(json, nullptr, false);
  REQUIRE_FALSE(parsed.is_discarded());
  CHECK(parsed["__metadata__"]["ckpt.item.layers.0.attn.weight"] == "kind=tensor xxh3=ffffffffffffffff");
  CHECK_THAT(mixed, Catch::Contains("\"ckpt.item.rng_state\":\"kind=blob xxh3=0123456789abcdef\""));
  CHECK(parsed["__blob__/rng_state"]["dtype"] == "U8");
}

TEST_CASE("a shard written by hand reads back and verifies", "[format]") {
  TempDir dir("fmt");
  HandShard shard = WriteShard(dir.path() + "/rank-00003.safetensors", SampleItems());
  std::string file = ReadFile(shard.path);
  REQUIRE(file.size() == shard.layout.file_bytes());

  auto info = ReadShardHeader(shard.path);
  REQUIRE(info.ok());
  CHECK(info->meta.job == "job-1");
  CHECK(info->meta.version == 42);
  CHECK(info->meta.rank == 3);
  CHECK(info->meta.world_size == 8);
  CHECK(info->data_start == shard.layout.header_bytes());
  CHECK(info->file_bytes == shard.layout.file_bytes());
  REQUIRE(info->items.size() == shard.layout.items().size());
  for (std::size_t i = 0; i < info->items.size(); ++i) {
    const ShardItem& got = info->items[i];
    const ShardItem& want = shard.layout.items()[i];
    INFO(want.name);
    CHECK(got.name == want.name);
    CHECK(got.kind == want.kind);
    CHECK(got.dtype == want.dtype);
    CHECK(got.shape == want.shape);
    CHECK(got.offset == want.offset);
    CHECK(got.length == want.length);
    CHECK(got.checksum == want.checksum);
    CHECK(file.substr(info->data_start + got.offset, got.length) == shard.data[i]);
  }
  Status verified = VerifyShard(shard.path);
  INFO(verified.message());
  CHECK(verified.ok());
}

TEST_CASE("VerifyShard reports a corrupted byte as data loss naming the item", "[format]") {
  TempDir dir("fmt");
  HandShard shard = WriteShard(dir.path() + "/s.safetensors", SampleItems());
  std::string file = ReadFile(shard.path);
  std::size_t which = GENERATE(0, 1, 4);  // weight, bias, blob
  const ShardItem& item = shard.layout.items()[which];
  std::size_t at = shard.layout.header_bytes() + item.offset + item.length / 2;
  file[at] = static_cast<char>(file[at] ^ 0x20);
  WriteBytes(shard.path, file);

  REQUIRE(ReadShardHeader(shard.path).ok());  // the header is intact
  Status s = VerifyShard(shard.path);
  INFO(s.message());
  REQUIRE(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Catch::Contains("'" + item.name + "'"));
  CHECK_THAT(s.message(), Catch::Contains("checksum"));
}

TEST_CASE("a checksum in the header that does not match the data is data loss", "[format]") {
  TempDir dir("fmt");
  std::string path = dir.path() + "/s.safetensors";
  HandShard shard = WriteShard(path, SampleItems());
  shard.layout.items()[3].checksum ^= 1;  // "scalar"
  std::string file = shard.layout.RenderHeader();
  for (const auto& d : shard.data) file += d;
  WriteBytes(path, file);
  Status s = VerifyShard(path);
  REQUIRE(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Catch::Contains("'scalar'"));
}

TEST_CASE("a truncated or extended shard is rejected", "[format]") {
  TempDir dir("fmt");
  std::string path = dir.path() + "/s.safetensors";
  HandShard shard = WriteShard(path, SampleItems());
  std::string file = ReadFile(path);

  SECTION("one byte short") {
    WriteBytes(path, file.substr(0, file.size() - 1));
    auto info = ReadShardHeader(path);
    REQUIRE(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Catch::Contains("truncated"));
    CHECK(VerifyShard(path).code() == StatusCode::kDataLoss);
  }
  SECTION("data section cut off entirely") {
    WriteBytes(path, file.substr(0, shard.layout.header_bytes()));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("one byte too many") {
    WriteBytes(path, file + "x");
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("shorter than the size prefix") {
    WriteBytes(path, file.substr(0, 5));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("empty file") {
    WriteBytes(path, "");
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("a shard whose header size prefix is wrong is rejected", "[format]") {
  TempDir dir("fmt");
  std::string path = dir.path() + "/s.safetensors";
  HandShard shard = WriteShard(path, SampleItems());
  std::string file = ReadFile(path);
  std::uint64_t n = LittleEndian64(file);
  REQUIRE(n == shard.layout.header_bytes() - 8);

  SECTION("larger than the file") {
    WriteBytes(path, Prefix(file.size()) + file.substr(8));
    auto info = ReadShardHeader(path);
    REQUIRE(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Catch::Contains("does not fit"));
  }
  SECTION("over the safetensors limit") {
    WriteBytes(path, Prefix(kMaxHeaderBytes + 1) + file.substr(8));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("so small that it cuts the JSON") {
    WriteBytes(path, Prefix(40) + file.substr(8));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("one block too large, moving the data section") {
    WriteBytes(path, Prefix(n + kDataAlignment) + file.substr(8));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
  SECTION("the all-ones size") {
    WriteBytes(path, std::string(8, '\xff') + file.substr(8));
    CHECK(ReadShardHeader(path).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("ParseShardHeader rejects holes and overlaps in the data offsets", "[format]") {
  // The reference case is accepted, so each rejection below is due to the bent field.
  REQUIRE(Parse(TwoItemHeader(0, 4, 4, 12), 12).ok());

  SECTION("hole between items") {
    auto info = Parse(TwoItemHeader(0, 4, 8, 12), 12);
    REQUIRE(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Catch::Contains("hole or overlap"));
  }
  SECTION("overlapping items") {
    auto info = Parse(TwoItemHeader(0, 8, 4, 12), 12);
    REQUIRE(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Catch::Contains("hole or overlap"));
  }
  SECTION("hole at the start") {
    CHECK(Parse(TwoItemHeader(4, 8, 8, 12), 12).status().code() == StatusCode::kDataLoss);
  }
  SECTION("unindexed bytes at the end") {
    CHECK(Parse(TwoItemHeader(0, 4, 4, 12), 13).status().code() == StatusCode::kDataLoss);
  }
  SECTION("items out of file order are fine if they tile the section") {
    auto info = Parse(TwoItemHeader(8, 12, 0, 8), 12);
    REQUIRE(info.ok());
    REQUIRE(info->items.size() == 2);
    CHECK(info->items[0].name == "b");  // sorted by offset
    CHECK(info->items[1].name == "a");
  }
  SECTION("end before begin") {
    CHECK(Parse(TwoItemHeader(4, 0, 4, 12), 12).status().code() == StatusCode::kDataLoss);
  }
  SECTION("an empty item at the offset of the next one is no overlap") {
    auto info = Parse(TwoItemHeader(0, 12, 0, 0), 12);
    REQUIRE(info.ok());
    REQUIRE(info->items.size() == 2);
    CHECK(info->items[0].name == "b");
    CHECK(info->items[0].length == 0);
  }
}

TEST_CASE("ParseShardHeader rejects malformed entries and metadata", "[format]") {
  auto h = TwoItemHeader(0, 4, 4, 12);
  REQUIRE(Parse(h, 12).ok());

  SECTION("shape disagrees with the offsets") { h["a"]["shape"] = {5}; }
  SECTION("shape and dtype disagree with the offsets") { h["b"]["dtype"] = "F64"; }
  SECTION("unknown dtype") { h["a"]["dtype"] = "F128"; }
  SECTION("negative dimension") { h["a"]["shape"] = {-4}; }
  SECTION("data_offsets of one element") { h["a"]["data_offsets"] = {0}; }
  SECTION("missing dtype") { h["a"].erase("dtype"); }
  SECTION("entry not an object") { h["a"] = "nope"; }
  SECTION("no __metadata__") { h.erase("__metadata__"); }
  SECTION("unknown format version") { h["__metadata__"]["ckpt.format_version"] = "3"; }
  SECTION("version not a number") { h["__metadata__"]["ckpt.version"] = "12x"; }
  SECTION("world size missing") { h["__metadata__"].erase("ckpt.world_size"); }
  SECTION("checksum missing") { h["__metadata__"].erase("ckpt.item.b"); }
  SECTION("checksum malformed") { h["__metadata__"]["ckpt.item.b"] = "kind=tensor xxh3=12345"; }
  SECTION("checksum in upper case") {
    h["__metadata__"]["ckpt.item.b"] = "kind=tensor xxh3=ABCDEF0123456789";
  }
  SECTION("kind disagrees with the key") {
    h["__metadata__"]["ckpt.item.b"] = "kind=blob xxh3=0000000000000000";
  }
  auto info = Parse(h, 12);
  INFO(h.dump());
  CHECK(info.status().code() == StatusCode::kDataLoss);
}

TEST_CASE("ParseShardHeader rejects text that is not a JSON object", "[format]") {
  for (const std::string& text : std::vector<std::string>{"", "[]", "{", "\"x\"", "{\"a\":1,}", "not json"}) {
    INFO(text);
    CHECK(ParseShardHeader(text, 8 + text.size()).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("Plan rejects a shape or dtype that disagrees with the length", "[format]") {
  SECTION("length one byte short") {
    ShardItem bad = Tensor("w", DType::kF32, {3});
    bad.length = 11;
    auto layout = ShardLayout::Plan(Meta(), {Tensor("ok", DType::kU8, {2}), bad});
    REQUIRE(layout.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(layout.status().message(), Catch::Contains("'w'"));
  }
  SECTION("length of another dtype") {
    ShardItem bad = Tensor("w", DType::kF32, {2, 2});
    bad.dtype = DType::kF64;
    CHECK(ShardLayout::Plan(Meta(), {bad}).status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("shape of another size") {
    ShardItem bad = Tensor("w", DType::kBF16, {2, 3});
    bad.shape = {3, 3};
    CHECK(ShardLayout::Plan(Meta(), {bad}).status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("negative dimension") {
    ShardItem bad = Tensor("w", DType::kU8, {4});
    bad.shape = {-2, -2};
    CHECK(ShardLayout::Plan(Meta(), {bad}).status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("shape whose element count overflows") {
    ShardItem bad = Tensor("w", DType::kU8, {4});
    bad.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
    bad.length = 0;
    CHECK(ShardLayout::Plan(Meta(), {bad}).status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("a zero dimension needs a zero length") {
    ShardItem bad = Tensor("w", DType::kF32, {0, 5});
    bad.length = 20;
    CHECK(ShardLayout::Plan(Meta(), {bad}).status().code() == StatusCode::kInvalidArgument);
    bad.length = 0;
    CHECK(ShardLayout::Plan(Meta(), {bad}).ok());
  }
}

TEST_CASE("an unplanned layout plans in place exactly like Plan", "[format]") {
  ShardLayout layout = ShardLayout::Unplanned(Meta(), SampleItems());
  CHECK_FALSE(layout.planned());
  REQUIRE(layout.PlanInPlace().ok());
  CHECK(layout.planned());
  auto planned = ShardLayout::Plan(Meta(), SampleItems());
  REQUIRE(planned.ok());
  CHECK(planned->planned());
  CHECK(layout.header_bytes() == planned->header_bytes());
  CHECK(layout.data_bytes() == planned->data_bytes());
  CHECK(layout.RenderHeader() == planned->RenderHeader());

  ShardItem bad = Tensor("w", DType::kF32, {3});
  bad.length = 13;
  CHECK(CheckItemShape(bad).code() == StatusCode::kInvalidArgument);
  CHECK(CheckItemShape(Tensor("w", DType::kF32, {3})).ok());
  ShardLayout unplannable = ShardLayout::Unplanned(Meta(), {Tensor("ok", DType::kU8, {1}), bad});
  CHECK(unplannable.PlanInPlace().code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(unplannable.planned());
}

TEST_CASE("Plan rejects duplicate item names", "[format]") {
  SECTION("two tensors") {
    auto layout = ShardLayout::Plan(
        Meta(), {Tensor("w", DType::kU8, {1}), Tensor("x", DType::kU8, {1}), Tensor("w", DType::kF32, {1})});
    REQUIRE(layout.status().code() == StatusCode::kAlreadyExists);
    CHECK_THAT(layout.status().message(), Catch::Contains("'w'"));
  }
  SECTION("a tensor and a blob share checksum metadata, so they may not share a name") {
    auto layout = ShardLayout::Plan(Meta(), {Tensor("state", DType::kU8, {1}), Blob("state", 3)});
    CHECK(layout.status().code() == StatusCode::kAlreadyExists);
  }
}

TEST_CASE("blobs are stored under the __blob__/ prefix and read back as blobs", "[format]") {
  ShardItem blob = Blob("rng", 5);
  CHECK(blob.TensorKey() == "__blob__/rng");
  CHECK(Tensor("rng", DType::kU8, {5}).TensorKey() == "rng");

  TempDir dir("fmt");
  std::string path = dir.path() + "/s.safetensors";
  WriteShard(path, {Tensor("w", DType::kU8, {3}), Blob("rng", 5), Blob("param_groups", 0)});
  std::string file = ReadFile(path);
  auto json = nlohmann::json::parse(file.substr(8, LittleEndian64(file)));
  CHECK(json.contains("__blob__/rng"));
  CHECK(json.contains("__blob__/param_groups"));
  CHECK_FALSE(json.contains("rng"));
  CHECK(json["__metadata__"]["ckpt.item.rng"].get<std::string>().rfind("kind=blob xxh3=", 0) == 0);

  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  REQUIRE(info->items.size() == 3);
  CHECK(info->items[1].name == "rng");
  CHECK(info->items[1].kind == ItemKind::kBlob);
  CHECK(info->items[1].length == 5);
  CHECK(info->items[2].name == "param_groups");
  CHECK(info->items[2].kind == ItemKind::kBlob);
  CHECK(info->items[0].kind == ItemKind::kTensor);
  CHECK(VerifyShard(path).ok());
}

TEST_CASE("an item named __metadata__ cannot replace the shard's metadata", "[format]") {
  // It is the one key safetensors reserves: a tensor of that name would replace the shard's
  // metadata and make the shard unreadable, so the name is refused before anything is planned.
  std::string err = CheckItemName("__metadata__");
  CHECK(err.find("reserved") != std::string::npos);
  CHECK(CheckItemName("__metadata__x").empty());
}

TEST_CASE("the checksum streams: pieces hash like the whole", "[format]") {
  std::string data = Bytes(100000, 7);
  std::uint64_t whole = Checksum::Of(data.data(), data.size());
  Checksum sum;
  std::size_t at = 0;
  for (std::size_t piece : {1u, 7u, 4096u, 30000u}) {
    sum.Update(data.data() + at, piece);
    at += piece;
  }
  sum.Update(data.data() + at, data.size() - at);
  CHECK(sum.Digest() == whole);
  CHECK(Checksum().Digest() == Checksum::Of(nullptr, 0));
  std::string other = data;
  other[50000] ^= 1;
  CHECK(Checksum::Of(other.data(), other.size()) != whole);
}

TEST_CASE("checksums print as 16 lowercase hex digits and parse back", "[format]") {
  CHECK(ChecksumHex(0) == "0000000000000000");
  CHECK(ChecksumHex(0xdeadbeefull) == "00000000deadbeef");
  CHECK(ChecksumHex(0xfedcba9876543210ull) == "fedcba9876543210");
  std::uint64_t v = 0;
  REQUIRE(ParseChecksumHex("fedcba9876543210", &v));
  CHECK(v == 0xfedcba9876543210ull);
  for (const std::string& bad :
       std::vector<std::string>{"", "fedcba987654321", "fedcba98765432100", "FEDCBA9876543210",
                                "fedcba987654321g", " edcba9876543210"}) {
    INFO(bad);
    CHECK_FALSE(ParseChecksumHex(bad, &v));
  }
}

TEST_CASE("CheckItemName accepts usual state names", "[names]") {
  for (const std::string& name : std::vector<std::string>{
           "layers.0.attn.weight", "model.embed_tokens.weight", "optimizer.state.12.exp_avg", "a",
           "rng-state_v2", "x.y", std::string(kMaxItemNameLength, 'n'), "weird but ok: ~!@#$%^&*()"}) {
    INFO(name);
    CHECK(CheckItemName(name).empty());
  }
}

TEST_CASE("CheckItemName rejects what could escape or corrupt a header", "[names]") {
  struct Case {
    std::string name;
    std::string why;
  };
  std::vector<Case> cases = {
      {"", "empty"},
      {std::string(kMaxItemNameLength + 1, 'n'), "longer than"},
      {"layers/0", "'/'"},
      {"/abs", "'/'"},
      {"..", "'..'"},
      {"a..b", "'..'"},
      {std::string("a\0b", 3), "NUL"},
      {"tab\there", "control"},
      {"new\nline", "control"},
      {"del\x7f", "control"},
      {"caf\xc3\xa9", "printable ASCII"},
  };
  for (const auto& c : cases) {
    INFO(QuoteName(c.name));
    std::string err = CheckItemName(c.name);
    CHECK_THAT(err, Catch::Contains(c.why));
  }
}

TEST_CASE("CheckJobId accepts directory-safe ids and rejects the rest", "[names]") {
  for (const std::string& job :
       std::vector<std::string>{"job-1", "llama_70b.run3", "A", "0", std::string(kMaxJobIdLength, 'j')}) {
    INFO(job);
    CHECK(CheckJobId(job).empty());
  }
  for (const std::string& job : std::vector<std::string>{
           std::string(), std::string(kMaxJobIdLength + 1, 'j'), std::string("."), std::string(".."),
           std::string(".hidden"), std::string("a/b"), std::string("../x"), std::string("a b"),
           std::string("a\0b", 3), std::string("tab\t"), std::string("caf\xc3\xa9"), std::string("x:y")}) {
    INFO(QuoteName(job));
    CHECK_FALSE(CheckJobId(job).empty());
  }
}

TEST_CASE("QuoteName escapes unprintable bytes and cuts long names", "[names]") {
  CHECK(QuoteName("abc") == "'abc'");
  CHECK(QuoteName(std::string("a\0b", 3)) == "'a\\x00b'");
  CHECK(QuoteName("it's") == "'it\\x27s'");
  std::string q = QuoteName(std::string(200, 'x'));
  CHECK(q.size() == 80 + 2 + 3);
  CHECK_THAT(q, Catch::EndsWith("...'"));
}

TEST_CASE("version directory names round-trip and nothing else parses", "[paths]") {
  CHECK(VersionDirName(42) == "v0000000042");
  CHECK(VersionDirName(0) == "v0000000000");
  CHECK(VersionDirName(12345678901ull) == "v12345678901");
  for (std::uint64_t v : {0ull, 1ull, 42ull, 9999999999ull, 12345678901ull}) {
    auto parsed = ParseVersionDirName(VersionDirName(v));
    REQUIRE(parsed.has_value());
    CHECK(*parsed == v);
  }
  // Only the canonical spelling: a stray "v3/COMMITTED" must not name version 3, whose
  // directory is v0000000003.
  for (const std::string& bad : std::vector<std::string>{
           "v7", "v3", "v00000000042", "v012345678901", "", "v", "V0000000042", "0000000042", "v-1", "v+1",
           "v12a", "v 12", "v0000000042.tmp", "v12345678901234567890", "set-aside", "latest"}) {
    INFO(bad);
    CHECK_FALSE(ParseVersionDirName(bad).has_value());
  }
}

TEST_CASE("shard file names round-trip and nothing else parses", "[paths]") {
  CHECK(ShardFileName(3) == "rank-00003.safetensors");
  CHECK(ShardFileName(123456) == "rank-123456.safetensors");
  for (std::uint32_t r : {0u, 3u, 99999u, 123456u, 4294967295u}) {
    auto parsed = ParseShardFileName(ShardFileName(r));
    REQUIRE(parsed.has_value());
    CHECK(*parsed == r);
  }
  for (const std::string& bad :
       std::vector<std::string>{"", "rank-.safetensors", "rank-00003.safetensors.tmp",
                                "rank-00003.safetensor", "rank-3x.safetensors", "rank--1.safetensors",
                                "Rank-00003.safetensors", "rank-4294967296.safetensors", "rank-00003",
                                "COMMITTED", "latest", "rank-3.safetensors", "rank-000003.safetensors"}) {
    INFO(bad);
    CHECK_FALSE(ParseShardFileName(bad).has_value());
  }
}
