// Global layouts, block checksums and for_rank (format/global_layout.h), shards of format 3
// (format/shard_format.h) and the per-version index (format/version_index.h), without a daemon.
#include "format/global_layout.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/checksum.h"
#include "format/shard_format.h"
#include "format/version_index.h"
#include "support/byte_pattern.h"
#include "support/shard_items.h"
#include "support/test_dirs.h"

using namespace ckpt;
using Catch::Contains;

namespace {

GlobalLayout Box(std::string global, std::vector<std::int64_t> shape, std::vector<std::int64_t> offsets) {
  GlobalLayout l;
  l.global_name = std::move(global);
  l.global_shape = std::move(shape);
  l.offsets = std::move(offsets);
  return l;
}

GlobalLayout Replicated(std::string global = "") {
  GlobalLayout l;
  l.global_name = std::move(global);
  l.replicated = true;
  return l;
}

Status Resolve(const std::string& item, std::vector<std::int64_t> shape, GlobalLayout l) {
  return ResolveLayout(item, shape, &l);
}

// A tensor item with a resolved layout (and block checksums unless replicated).
ShardItem LaidOut(std::string name, DType dtype, std::vector<std::int64_t> shape, GlobalLayout l,
                  std::uint64_t block_bytes = kBlockBytes) {
  ShardItem item = test::TensorItem(std::move(name), dtype, std::move(shape));
  REQUIRE(ResolveLayout(item.name, item.shape, &l).ok());
  if (!l.replicated) item.blocks.block_bytes = block_bytes;
  item.layout = std::move(l);
  return item;
}

// A header of `items` with their checksums (and block checksums) set from the given bytes.
std::string Header(const ShardMeta& meta, std::vector<ShardItem> items, ShardLayout* out = nullptr) {
  auto layout = ShardLayout::Plan(meta, std::move(items));
  REQUIRE(layout.ok());
  std::uint32_t seed = 1;
  for (auto& item : layout->items()) {
    const std::string bytes = test::Bytes(item.length, seed++);
    item.checksum = Checksum::Of(bytes.data(), bytes.size());
    if (item.blocks.block_bytes != 0) {
      item.blocks.sums = ComputeBlockSums(bytes.data(), bytes.size(), item.blocks.block_bytes);
    }
  }
  std::string header = layout->RenderHeader();
  if (out) *out = std::move(layout).value();
  return header;
}

Result<ShardInfo> ParseRendered(const std::string& header, std::uint64_t data_bytes) {
  return ParseShardHeader(std::string_view(header).substr(8), header.size() + data_bytes);
}

// The JSON of a rendered header, to bend, and its text back with the same size prefix.
nlohmann::json JsonOf(const std::string& header) {
  return nlohmann::json::parse(std::string_view(header).substr(8));
}
Result<ShardInfo> ParseJson(const nlohmann::json& j, std::uint64_t data_bytes) {
  const std::string text = j.dump();
  return ParseShardHeader(text, 8 + text.size() + data_bytes);
}

}  // namespace

TEST_CASE("ResolveLayout fills defaults and accepts boxes within the global shape", "[layout]") {
  GlobalLayout l = Box("", {8, 6}, {4, 3});
  REQUIRE(ResolveLayout("w.part", {4, 3}, &l).ok());
  CHECK(l.global_name == "w.part");
  CHECK(l.global_shape == std::vector<std::int64_t>{8, 6});

  GlobalLayout r = Replicated();
  REQUIRE(ResolveLayout("norm", {5, 2}, &r).ok());
  CHECK(r.global_name == "norm");
  CHECK(r.global_shape == std::vector<std::int64_t>{5, 2});
  CHECK(r.offsets == std::vector<std::int64_t>{0, 0});
  GlobalLayout r2 = Replicated("g");
  r2.global_shape = {5, 2};
  r2.offsets = {0, 0};
  REQUIRE(ResolveLayout("norm", {5, 2}, &r2).ok());

  CHECK(Resolve("scalar", {}, Box("s", {}, {})).ok());
  CHECK(Resolve("empty", {0, 4}, Box("e", {3, 4}, {3, 0})).ok());  // an empty box at the end
  CHECK(Resolve("edge", {2, 6}, Box("e", {8, 6}, {6, 0})).ok());
}

TEST_CASE("ResolveLayout refuses a bad layout with INVALID_ARGUMENT naming the item", "[layout]") {
  struct Case {
    const char* what;
    std::vector<std::int64_t> shape;
    GlobalLayout layout;
    const char* says;
  };
  GlobalLayout rep_shape = Replicated();
  rep_shape.global_shape = {4, 4};
  GlobalLayout rep_offsets = Replicated();
  rep_offsets.offsets = {0, 1};
  const std::vector<Case> cases = {
      {"fewer offsets than dimensions", {4, 3}, Box("g", {8, 6}, {4}), "one entry per dimension"},
      {"more global dimensions", {4, 3}, Box("g", {8, 6, 1}, {0, 0}), "one entry per dimension"},
      {"a negative offset", {4, 3}, Box("g", {8, 6}, {-1, 0}), "negative"},
      {"a negative global dimension", {4, 3}, Box("g", {-8, 6}, {0, 0}), "negative"},
      {"a box past the end", {4, 3}, Box("g", {8, 6}, {5, 0}), "does not fit the global shape"},
      {"an item larger than the global tensor", {4, 7}, Box("g", {8, 6}, {0, 0}), "in dimension 1"},
      {"a huge offset", {4, 3}, Box("g", {8, 6}, {INT64_MAX, 0}), "does not fit"},
      {"a global name with a slash", {4, 3}, Box("a/b", {8, 6}, {0, 0}), "global name"},
      {"a replicated item of another global shape", {4, 3}, rep_shape, "is replicated but its global shape"},
      {"a replicated item with offsets", {4, 3}, rep_offsets, "is replicated but has offsets"},
      {"a global shape that overflows",
       {1, 1, 1},
       Box("g", {INT64_MAX, INT64_MAX, INT64_MAX}, {0, 0, 0}),
       "overflows"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    Status s = Resolve("layers.0.w", c.shape, c.layout);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Contains("'layers.0.w'") && Contains(c.says));
  }
}

TEST_CASE("layouts encode as compact JSON and decode back", "[layout]") {
  GlobalLayout box = Box("model.w\"q", {8, 6}, {4, 0});
  CHECK(EncodeLayout(box) == R"({"global":"model.w\"q","shape":[8,6],"offsets":[4,0]})");
  auto back = DecodeLayout(EncodeLayout(box));
  REQUIRE(back.ok());
  CHECK(back.value() == box);
  GlobalLayout rep = Replicated("n");
  REQUIRE(ResolveLayout("n", {3}, &rep).ok());
  CHECK(EncodeLayout(rep) == R"({"global":"n","replicated":true})");
  auto rep_back = DecodeLayout(EncodeLayout(rep));
  REQUIRE(rep_back.ok());
  CHECK(rep_back->replicated);
  CHECK(rep_back->global_shape.empty());
  // Any key order and white space.
  auto spaced = DecodeLayout(R"( { "offsets" : [1], "global" : "x", "shape" : [2] } )");
  REQUIRE(spaced.ok());
  CHECK(spaced.value() == Box("x", {2}, {1}));

  for (const char* bad :
       {"", "[]", "{", R"({"shape":[1],"offsets":[0]})", R"({"global":1,"shape":[1],"offsets":[0]})",
        R"({"global":"x","shape":[1]})", R"({"global":"x","offsets":[1]})",
        R"({"global":"x","shape":[-1],"offsets":[0]})", R"({"global":"x","shape":[1.5],"offsets":[0]})",
        R"({"global":"x","shape":[1],"offsets":[0],"extra":1})", R"({"global":"x","replicated":false})",
        R"({"global":"x","replicated":true,"shape":[1]})", R"({"global":"","shape":[1],"offsets":[0]})",
        R"({"global":"..","shape":[1],"offsets":[0]})",
        R"({"global":"x","shape":[9223372036854775808],"offsets":[0]})"}) {
    INFO(bad);
    CHECK(DecodeLayout(bad).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("block checksums encode, decode and verify whole blocks of a range", "[layout]") {
  const std::uint64_t bs = kMinBlockBytes;
  const std::string bytes = test::Bytes(3 * bs + 100, 7);
  BlockSums blocks{bs, ComputeBlockSums(bytes.data(), bytes.size(), bs)};
  REQUIRE(blocks.sums.size() == 4);
  CHECK(blocks.sums[3] == Checksum::Of(bytes.data() + 3 * bs, 100));
  const std::string text = EncodeBlockSums(blocks);
  CHECK(text == "4096 " + ChecksumHex(blocks.sums[0]) + ChecksumHex(blocks.sums[1]) +
                    ChecksumHex(blocks.sums[2]) + ChecksumHex(blocks.sums[3]));
  auto back = DecodeBlockSums(text, bytes.size());
  REQUIRE(back.ok());
  CHECK(back->block_bytes == bs);
  CHECK(back->sums == blocks.sums);
  auto none = DecodeBlockSums("1048576 ", 0);
  REQUIRE(none.ok());
  CHECK(none->sums.empty());

  for (const std::string& bad :
       {std::string(""), std::string("4096"), " " + text.substr(5), "04096 " + text.substr(5),
        "4095 " + text.substr(5), "2147483648 " + text.substr(5), text.substr(0, text.size() - 16),
        text + "0000000000000000", text.substr(0, text.size() - 1) + "g", "40x6 " + text.substr(5)}) {
    INFO(bad.substr(0, 40));
    CHECK(DecodeBlockSums(bad, bytes.size()).status().code() == StatusCode::kDataLoss);
  }

  // Bytes [5000, 9000) need blocks 1 and 2: [4096, 12288).
  BlockSpan span = BlocksCovering(5000, 9000, bytes.size(), bs);
  CHECK(span.first_block == 1);
  CHECK(span.end_block == 3);
  CHECK(span.begin == bs);
  CHECK(span.end == 3 * bs);
  BlockSpan tail = BlocksCovering(3 * bs + 10, bytes.size(), bytes.size(), bs);
  CHECK(tail.first_block == 3);
  CHECK(tail.end_block == 4);
  CHECK(tail.end == bytes.size());
  BlockSpan empty = BlocksCovering(100, 100, bytes.size(), bs);
  CHECK(empty.begin == empty.end);

  CHECK(VerifyBlocks(blocks, bytes.size(), span.begin, bytes.data() + span.begin, span.end - span.begin, "w")
            .ok());
  CHECK(VerifyBlocks(blocks, bytes.size(), tail.begin, bytes.data() + tail.begin, tail.end - tail.begin, "w")
            .ok());
  CHECK(VerifyBlocks(blocks, bytes.size(), 0, bytes.data(), bytes.size(), "w").ok());
  std::string bent = bytes;
  bent[2 * bs + 17] ^= 1;
  Status s = VerifyBlocks(blocks, bytes.size(), span.begin, bent.data() + span.begin, span.end - span.begin,
                          "item 'w' of rank 3");
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Contains("item 'w' of rank 3") && Contains("block 2") &&
                              Contains("bytes 8192-12288") && Contains(ChecksumHex(blocks.sums[2])));
  CHECK(VerifyBlocks(blocks, bytes.size(), 100, bytes.data() + 100, bs, "w").code() ==
        StatusCode::kInvalidArgument);
  CHECK(VerifyBlocks(blocks, bytes.size(), 0, bytes.data(), bs + 1, "w").code() ==
        StatusCode::kInvalidArgument);
  CHECK(VerifyBlocks(BlockSums{}, bytes.size(), 0, bytes.data(), bs, "w").code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("for_rank decodes only canonical ranks below the world size", "[layout]") {
  CHECK(DecodeForRank(EncodeForRank(3), 4).value() == 3);
  CHECK(DecodeForRank("0", 1).value() == 0);
  for (const char* bad : {"", "4", "03", "-1", "1 ", "x", "99999999999"}) {
    INFO(bad);
    CHECK(DecodeForRank(bad, 4).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("a shard of format 3 round-trips layouts, block checksums and for_rank", "[format]") {
  const ShardMeta meta{"job-1", 42, 1, 4, "reg"};
  ShardItem blob_for = test::BlobItem("rng.1", 5);
  blob_for.for_rank = 1;
  std::vector<ShardItem> items = {
      LaidOut("w", DType::kF32, {512, 300}, Box("model.w", {1024, 600}, {512, 300})),  // 600 KB: 1 block
      LaidOut("emb", DType::kBF16, {1000, 1024},
              Box("embedding", {4000, 1024}, {1000, 0})),  // 2 MB: 2 blocks
      LaidOut("norm", DType::kF32, {64}, Replicated()),
      test::TensorItem("step", DType::kI64, {1}),
      test::BlobItem("groups", 7),
      blob_for,
  };
  ShardLayout layout;
  const std::string header = Header(meta, items, &layout);
  auto info = ParseRendered(header, layout.data_bytes());
  INFO(info.status().message());
  REQUIRE(info.ok());
  CHECK(info->format_version == "3");
  REQUIRE(info->items.size() == items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const ShardItem& want = layout.items()[i];
    const ShardItem& got = info->items[i];
    INFO(want.name);
    CHECK(got.layout == want.layout);
    CHECK(got.blocks.block_bytes == want.blocks.block_bytes);
    CHECK(got.blocks.sums == want.blocks.sums);
    CHECK(got.for_rank == want.for_rank);
  }
  CHECK(info->items[1].blocks.sums.size() == 2);
  CHECK(info->items[2].layout->replicated);
  CHECK_FALSE(info->items[3].layout.has_value());

  const nlohmann::json md = JsonOf(header)["__metadata__"];
  CHECK(md["ckpt.format_version"] == "3");
  CHECK(md["ckpt.layout.w"] == R"({"global":"model.w","shape":[1024,600],"offsets":[512,300]})");
  CHECK(md["ckpt.layout.norm"] == R"({"global":"norm","replicated":true})");
  CHECK(md["ckpt.blocks.emb"].get<std::string>().starts_with("1048576 "));
  CHECK(md["ckpt.blocks.emb"].get<std::string>().size() == 8 + 32);
  CHECK_FALSE(md.contains("ckpt.blocks.norm"));
  CHECK_FALSE(md.contains("ckpt.layout.step"));
  CHECK(md["ckpt.for_rank.rng.1"] == "1");
  CHECK_FALSE(md.contains("ckpt.for_rank.groups"));
}

TEST_CASE("a shard without layouts, block checksums or for_rank stays format 2, as before", "[format]") {
  // The bytes format 2 has always had: this JSON is what the writer before format 3 (at
  // 021fceb) rendered for these items.
  ShardItem w = test::TensorItem("w", DType::kF32, {2});
  w.checksum = 0x0123456789abcdefull;
  ShardItem b = test::BlobItem("rng", 3);
  b.checksum = 0xfedcba9876543210ull;
  auto layout = ShardLayout::Plan(ShardMeta{"j", 7, 0, 2, "s"}, {w, b});
  REQUIRE(layout.ok());
  layout->items()[0].checksum = w.checksum;
  layout->items()[1].checksum = b.checksum;
  const std::string header = layout->RenderHeader();
  REQUIRE(header.size() == 4096);
  const std::string json = header.substr(8, header.find_last_not_of(' ') - 7);
  CHECK(json ==
        R"({"__metadata__":{"ckpt.format_version":"2","ckpt.job":"j","ckpt.version":"7","ckpt.rank":"0",)"
        R"("ckpt.world_size":"2","ckpt.session":"s","ckpt.item.w":"kind=tensor xxh3=0123456789abcdef",)"
        R"("ckpt.item.rng":"kind=blob xxh3=fedcba9876543210","ckpt.header_xxh3":"a4d72f36b3f70363"},)"
        R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__blob__/rng":{"dtype":"U8","shape":[3],)"
        R"("data_offsets":[8,11]}})");
  CHECK(HeaderDigestText(layout->meta(), layout->items()).starts_with("ckptd-shard-header 2 "));
}

TEST_CASE("the header checksum covers layouts, block checksums and for_rank", "[format]") {
  const ShardMeta meta{"j", 1, 0, 2, ""};
  ShardItem blob = test::BlobItem("b", 4);
  blob.for_rank = 1;
  ShardLayout layout;
  const std::string header = Header(
      meta, {LaidOut("w", DType::kU8, {8192}, Box("g", {16384}, {8192}), kMinBlockBytes), blob}, &layout);
  REQUIRE(ParseRendered(header, layout.data_bytes()).ok());
  auto digest = HeaderDigestText(layout.meta(), layout.items());
  CHECK(digest.starts_with("ckptd-shard-header 3 "));
  CHECK_THAT(digest, Contains(R"( layout 47:{"global":"g","shape":[16384],"offsets":[8192]} blocks 4096 )"));
  CHECK_THAT(digest, Contains(" for_rank 1\n"));

  // Each bent the same length, so only the checksum can tell.
  struct Bend {
    const char* what;
    std::string from, to;
  };
  const std::string sum0 = ChecksumHex(layout.items()[0].blocks.sums[0]);
  std::string sum0_bent = sum0;
  sum0_bent[0] = sum0_bent[0] == '0' ? '1' : '0';
  const std::vector<Bend> bends = {
      {"another offset", R"(\"offsets\":[8192])", R"(\"offsets\":[8191])"},
      {"another global name", R"(\"global\":\"g\")", R"(\"global\":\"h\")"},
      {"another block checksum", sum0, sum0_bent},
      {"another for_rank", R"("ckpt.for_rank.b":"1")", R"("ckpt.for_rank.b":"0")"},
  };
  for (const auto& bend : bends) {
    INFO(bend.what);
    std::string bent = header;
    const auto at = bent.find(bend.from);
    REQUIRE(at != std::string::npos);
    bent.replace(at, bend.from.size(), bend.to);
    REQUIRE(bent.size() == header.size());
    auto info = ParseRendered(bent, layout.data_bytes());
    CHECK(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Contains("header checksum mismatch"));
  }
}

TEST_CASE("ParseShardHeader refuses malformed or misplaced keys of format 3", "[format]") {
  const ShardMeta meta{"j", 1, 0, 2, ""};
  ShardLayout layout;
  const std::string header = Header(meta,
                                    {LaidOut("w", DType::kU8, {8192}, Box("g", {16384}, {0}), kMinBlockBytes),
                                     test::TensorItem("p", DType::kU8, {4}), test::BlobItem("b", 4)},
                                    &layout);
  const std::uint64_t data = layout.data_bytes();
  REQUIRE(ParseJson(JsonOf(header), data).ok());

  struct Case {
    const char* what;
    const char* key;
    nlohmann::json value;  // null: remove the key
    const char* says;
  };
  const std::vector<Case> cases = {
      {"a layout that is not JSON", "ckpt.layout.w", "{", "ckpt.layout.<item> of item 'w' is malformed"},
      {"a layout past the global shape", "ckpt.layout.w", R"({"global":"g","shape":[100],"offsets":[0]})",
       "does not fit the global shape"},
      {"a layout of another rank", "ckpt.layout.w", R"({"global":"g","shape":[16384,1],"offsets":[0,0]})",
       "one entry per dimension"},
      {"a layout on a blob", "ckpt.layout.b", R"({"global":"g","replicated":true})", "blob 'b' has a layout"},
      {"a for_rank on a tensor", "ckpt.for_rank.p", "1", "tensor 'p' has a for_rank"},
      {"a for_rank past the world size", "ckpt.for_rank.b", "2", "not a rank of world size 2"},
      {"block checksums of the wrong count", "ckpt.blocks.w", "4096 0000000000000000",
       "16 for each of 2 blocks"},
      {"block checksums on a blob", "ckpt.blocks.b", "4096 0000000000000000",
       "blob 'b' has a layout or block"},
      {"a key of no item", "ckpt.layout.nothing", R"({"global":"g","replicated":true})", "key of no item"},
      {"a layout that is not a string", "ckpt.layout.w", 3, "is not a string"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    nlohmann::json j = JsonOf(header);
    j["__metadata__"][c.key] = c.value;
    auto info = ParseJson(j, data);
    CHECK(info.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(info.status().message(), Contains(c.says));
  }
  // A format 2 shard never has them.
  nlohmann::json j = JsonOf(header);
  j["__metadata__"]["ckpt.format_version"] = "2";
  auto info = ParseJson(j, data);
  CHECK(info.status().code() == StatusCode::kDataLoss);
  CHECK_THAT(info.status().message(), Contains("only format 3 has"));
  j["__metadata__"]["ckpt.format_version"] = "5";
  CHECK_THAT(ParseJson(j, data).status().message(), Contains("knows 1 to 4"));
}

TEST_CASE("a layout that planning cannot store is refused", "[format]") {
  ShardItem unresolved = test::TensorItem("w", DType::kU8, {4});
  unresolved.layout = Box("", {8}, {0});  // global name not filled in
  CHECK(ShardLayout::Plan(ShardMeta{"j", 1, 0, 1, ""}, {unresolved}).status().code() ==
        StatusCode::kInvalidArgument);
  ShardItem small_blocks = test::TensorItem("w", DType::kU8, {4});
  small_blocks.blocks.block_bytes = 512;
  CHECK_THAT(ShardLayout::Plan(ShardMeta{"j", 1, 0, 1, ""}, {small_blocks}).status().message(),
             Contains("block size 512 is out of range"));
  ShardItem blob = test::BlobItem("b", 4);
  blob.layout = Replicated("b");
  CHECK(ShardLayout::Plan(ShardMeta{"j", 1, 0, 1, ""}, {blob}).status().code() ==
        StatusCode::kInvalidArgument);
}

namespace {

// The shards of a version written by 4 ranks: "w" [4, 6] in a 2x2 grid of [2, 3] boxes,
// "emb" [8, 2] split by rows, "norm" replicated, "step" private, blob "rng" on every rank and
// blob "sampler" of rank 2 for rank 1 only.
std::vector<ShardInfo> FourRanks() {
  std::vector<ShardInfo> shards;
  for (std::uint32_t r = 0; r < 4; ++r) {
    ShardInfo info;
    info.meta = ShardMeta{"job-1", 42, r, 4, "reg"};
    info.format_version = "3";
    info.items.push_back(LaidOut("w", DType::kF32, {2, 3}, Box("w", {4, 6}, {(r / 2) * 2, (r % 2) * 3})));
    info.items.push_back(LaidOut("emb.part", DType::kBF16, {2, 2}, Box("emb", {8, 2}, {2 * r, 0})));
    info.items.push_back(LaidOut("norm", DType::kF32, {3}, Replicated()));
    info.items.push_back(test::TensorItem("step", DType::kI64, {1}));
    info.items.push_back(test::BlobItem("rng", 5 + r));
    if (r == 2) {
      ShardItem sampler = test::BlobItem("sampler", 9);
      sampler.for_rank = 1;
      info.items.push_back(sampler);
    }
    shards.push_back(std::move(info));
  }
  return shards;
}

}  // namespace

TEST_CASE("the index of a version lists global tensors, private items and blobs and parses back", "[index]") {
  std::vector<ShardInfo> shards = FourRanks();
  std::swap(shards[0], shards[3]);  // any order
  auto index = VersionIndex::Build(shards);
  INFO(index.status().message());
  REQUIRE(index.ok());
  CHECK(index->job == "job-1");
  CHECK(index->version == 42);
  CHECK(index->world_size == 4);
  REQUIRE(index->tensors.size() == 3);
  const IndexTensor& w = index->tensors.at("w");
  CHECK(w.dtype == DType::kF32);
  CHECK(w.shape == std::vector<std::int64_t>{4, 6});
  CHECK_FALSE(w.replicated);
  REQUIRE(w.chunks.size() == 4);
  CHECK(w.chunks[3] == IndexChunk{3, "rank-00003.safetensors", "w", {2, 3}, {2, 3}});
  const IndexTensor& emb = index->tensors.at("emb");
  CHECK(emb.dtype == DType::kBF16);
  CHECK(emb.chunks[1] == IndexChunk{1, "rank-00001.safetensors", "emb.part", {2, 0}, {2, 2}});
  const IndexTensor& norm = index->tensors.at("norm");
  CHECK(norm.replicated);
  REQUIRE(norm.chunks.size() == 4);
  CHECK(norm.chunks[2] == IndexChunk{2, "rank-00002.safetensors", "norm", {0}, {3}});
  REQUIRE(index->private_items.size() == 4);
  CHECK(index->private_items.at(1) ==
        std::vector<IndexItem>{{"step", "rank-00001.safetensors", "step", DType::kI64, {1}}});
  REQUIRE(index->blobs.size() == 5);
  CHECK(index->blobs[0] == IndexBlob{0, "rng", "rank-00000.safetensors", "__blob__/rng", 5, std::nullopt});
  CHECK(index->blobs[3] == IndexBlob{2, "sampler", "rank-00002.safetensors", "__blob__/sampler", 9, 1});

  const std::string text = index->Render();
  auto parsed = VersionIndex::Parse(text);
  INFO(parsed.status().message());
  REQUIRE(parsed.ok());
  CHECK(parsed.value() == index.value());
  // The schema, checked with a JSON reader of its own.
  const auto j = nlohmann::json::parse(text);
  CHECK(j["format"] == "ckptd-index/1");
  CHECK(j["world_size"] == 4);
  CHECK(
      j["tensors"]["w"]["chunks"][3] ==
      nlohmann::json::parse(
          R"({"rank": 3, "file": "rank-00003.safetensors", "key": "w", "offsets": [2, 3], "shape": [2, 3]})"));
  CHECK(j["private"]["0"][0] == nlohmann::json::parse(R"({"name": "step", "file": "rank-00000.safetensors",
                                                         "key": "step", "dtype": "I64", "shape": [1]})"));
  CHECK(j["blobs"][0]["for_rank"].is_null());
  CHECK(j["blobs"][3]["for_rank"] == 1);
  // One chunk, item or blob a line.
  CHECK(std::count(text.begin(), text.end(), '\n') > 4 + 4 + 4 + 4 + 5);
}

TEST_CASE("the index of a version without layouts lists its items as private", "[index]") {
  ShardInfo only;
  only.meta = ShardMeta{"j", 3, 0, 1, ""};
  only.items = {test::TensorItem("w", DType::kF32, {2}), test::BlobItem("b", 1)};
  auto index = VersionIndex::Build({only});
  REQUIRE(index.ok());
  CHECK(index->tensors.empty());
  CHECK(index->private_items.at(0).size() == 1);
  CHECK(index->Render() ==
        "{\"format\": \"ckptd-index/1\", \"job\": \"j\", \"version\": 3, \"world_size\": 1,\n"
        " \"tensors\": {},\n"
        " \"private\": {\n"
        "  \"0\": [\n"
        "    {\"name\": \"w\", \"file\": \"rank-00000.safetensors\", \"key\": \"w\", \"dtype\": \"F32\", "
        "\"shape\": [2]}]},\n"
        " \"blobs\": [\n"
        "  {\"rank\": 0, \"name\": \"b\", \"file\": \"rank-00000.safetensors\", \"key\": \"__blob__/b\", "
        "\"bytes\": 1, "
        "\"for_rank\": null}]}\n");
}

TEST_CASE("Build refuses ranks that disagree on a global tensor, overlap or leave a hole", "[index]") {
  struct Case {
    const char* what;
    std::function<void(std::vector<ShardInfo>&)> bend;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"another dtype",
       [](auto& s) {
         s[1].items[0] = LaidOut("w", DType::kF16, {2, 3}, Box("w", {4, 6}, {0, 3}));
       },
       StatusCode::kFailedPrecondition,
       "global tensor 'w' is declared as F32 [4, 6] by rank 0 ('w') but as F16"},
      {"another global shape",
       [](auto& s) {
         s[2].items[1] = LaidOut("emb.part", DType::kBF16, {2, 2}, Box("emb", {9, 2}, {4, 0}));
       },
       StatusCode::kFailedPrecondition, "global tensor 'emb'"},
      {"replicated on one rank only",
       [](auto& s) {
         s[3].items[0] = LaidOut("w", DType::kF32, {4, 6}, Replicated());
       },
       StatusCode::kFailedPrecondition, "replicated by rank 3"},
      {"two chunks that overlap",
       [](auto& s) {
         s[3].items[1] = LaidOut("emb.part", DType::kBF16, {2, 2}, Box("emb", {8, 2}, {5, 0}));
       },
       StatusCode::kFailedPrecondition, "overlaps the chunk of rank 3"},
      {"a hole", [](auto& s) { s[3].items.erase(s[3].items.begin() + 1); }, StatusCode::kFailedPrecondition,
       "cover only 12 of them"},
      {"a rank missing", [](auto& s) { s.pop_back(); }, StatusCode::kInvalidArgument,
       "rank 3 of 4 is missing"},
      {"a rank twice", [](auto& s) { s[3].meta.rank = 2; }, StatusCode::kInvalidArgument,
       "rank 2 of world size 4"},
      {"another version", [](auto& s) { s[1].meta.version = 41; }, StatusCode::kInvalidArgument,
       "version 41"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    std::vector<ShardInfo> shards = FourRanks();
    c.bend(shards);
    auto index = VersionIndex::Build(shards);
    CHECK(index.status().code() == c.code);
    CHECK_THAT(index.status().message(), Contains(c.says));
  }
  CHECK(VersionIndex::Build({}).status().code() == StatusCode::kInvalidArgument);
  // A 2-D grid split along the second dimension first: no overlap is found where there is none.
  std::vector<ShardInfo> columns(1);
  columns[0].meta = ShardMeta{"j", 1, 0, 1, ""};
  for (std::int64_t c = 0; c < 50; ++c) {
    for (std::int64_t r = 0; r < 2; ++r) {
      columns[0].items.push_back(LaidOut("w" + std::to_string(c) + "." + std::to_string(r), DType::kU8,
                                         {3, 1}, Box("g", {6, 50}, {3 * r, c})));
    }
  }
  CHECK(VersionIndex::Build(columns).ok());
}

TEST_CASE("VersionIndex::Parse refuses a bad index with a clear error, never a crash", "[index]") {
  auto index = VersionIndex::Build(FourRanks());
  REQUIRE(index.ok());
  const nlohmann::json good = nlohmann::json::parse(index->Render());
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> bend;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"another format", [](auto& j) { j["format"] = "ckptd-index/2"; }, "top level.format: is not"},
      {"an unknown member", [](auto& j) { j["extra"] = 1; }, "unknown member 'extra'"},
      {"no blobs", [](auto& j) { j.erase("blobs"); }, "lacks \"blobs\""},
      {"a bad job", [](auto& j) { j["job"] = "../x"; }, "job: is not a job id"},
      {"world size 0", [](auto& j) { j["world_size"] = 0; }, "world_size: is 0"},
      {"a negative version", [](auto& j) { j["version"] = -1; }, "version: is not an integer"},
      {"an unknown dtype", [](auto& j) { j["tensors"]["w"]["dtype"] = "F33"; },
       "tensors.'w'.dtype: is an unknown"},
      {"a chunk past the tensor",
       [](auto& j) {
         j["tensors"]["w"]["chunks"][3]["offsets"] = {3, 3};
       },
       "tensors.'w'.chunks[3]: box at [3, 3]"},
      {"a chunk of another rank count", [](auto& j) { j["tensors"]["w"]["chunks"][0]["shape"] = {2}; },
       "for a tensor of shape [4, 6]"},
      {"a rank past the world size", [](auto& j) { j["tensors"]["w"]["chunks"][0]["rank"] = 4; },
       "chunks[0].rank: is not an integer from 0 to 3"},
      {"another rank's file",
       [](auto& j) { j["tensors"]["w"]["chunks"][1]["file"] = "rank-00000.safetensors"; },
       "chunks[1].file: is not rank-00001.safetensors"},
      {"a file outside the version",
       [](auto& j) { j["tensors"]["w"]["chunks"][0]["file"] = "../../etc/passwd"; },
       "is not rank-00000.safetensors"},
      {"a part of a replicated tensor", [](auto& j) { j["tensors"]["norm"]["chunks"][0]["shape"] = {2}; },
       "replicated tensor but not the whole"},
      {"a key with a slash", [](auto& j) { j["tensors"]["w"]["chunks"][0]["key"] = "a/b"; }, "key:"},
      {"a private rank that is no rank", [](auto& j) { j["private"]["07"] = nlohmann::json::array(); },
       "private.'07': is not a rank"},
      {"a blob of bytes -1", [](auto& j) { j["blobs"][0]["bytes"] = -1; }, "blobs[0].bytes"},
      {"a blob for rank 9", [](auto& j) { j["blobs"][0]["for_rank"] = 9; }, "blobs[0].for_rank"},
      {"tensors an array", [](auto& j) { j["tensors"] = nlohmann::json::array(); },
       "tensors: is not an object"},
      {"a chunk a number", [](auto& j) { j["tensors"]["w"]["chunks"][0] = 1; },
       "chunks[0]: is not an object"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    nlohmann::json j = good;
    c.bend(j);
    auto parsed = VersionIndex::Parse(j.dump());
    CHECK(parsed.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(parsed.status().message(), Contains("index.json") && Contains(c.says));
  }
  for (const char* text : {"", "nul", "[]", "{\"format\":", "3"}) {
    INFO(text);
    CHECK(VersionIndex::Parse(text).status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("VerifyShard checks block checksums and names the block", "[format]") {
  test::TempDir dir("verify3");
  const std::string path = dir.path() + "/rank-00000.safetensors";
  ShardLayout layout;
  std::vector<ShardItem> items = {LaidOut("w", DType::kU8, {10000}, Box("g", {20000}, {0}), kMinBlockBytes),
                                  test::BlobItem("b", 3)};
  const std::string header = Header(ShardMeta{"j", 1, 0, 1, ""}, items, &layout);
  // The bytes Header() took the checksums of.
  std::string file = header + test::Bytes(10000, 1) + test::Bytes(3, 2);
  auto write = [&](const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  write(file);
  REQUIRE(VerifyShard(path).ok());
  file[header.size() + 5000] ^= 0x10;  // in block 1
  write(file);
  Status s = VerifyShard(path);
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Contains("block 1 of item 'w'"));
}
