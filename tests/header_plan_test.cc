// Headers rendered from a TensorPlan (tensors planned once per table generation, blobs and
// identity per version) against headers rendered from the whole item list by ShardLayout::Plan:
// the bytes must be the same, for any items, blobs, identity and checksums.
#include <catch2/catch.hpp>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "daemon/pipeline/shard_job.h"
#include "format/shard_format.h"
#include "support/shard_items.h"

using namespace ckpt;

namespace {

ShardItem Tensor(std::string name, DType dtype, std::vector<std::int64_t> shape) {
  return test::TensorItem(std::move(name), dtype, std::move(shape));
}
ShardItem Blob(std::string name, std::uint64_t bytes) { return test::BlobItem(std::move(name), bytes); }

// Names that sort before and after "__blob__/" and need JSON escapes.
std::vector<ShardItem> ManyTensors(std::size_t n, std::uint32_t seed, std::int64_t widen = 0) {
  std::mt19937 rng(seed);
  static const char* kStems[] = {"layers.", "A", "_", "__blob", "z\"q", "tab\t", "\xc3\xa9t\xc3\xa9", "0"};
  std::vector<ShardItem> items;
  for (std::size_t i = 0; i < n; ++i) {
    std::string name = std::string(kStems[rng() % 8]) + std::to_string(i) + ".w";
    switch (rng() % 4) {
      case 0:
        items.push_back(Tensor(name, DType::kF32, {std::int64_t(rng() % 9) + widen, 3}));
        break;
      case 1:
        items.push_back(Tensor(name, DType::kBF16, {std::int64_t(rng() % 5)}));
        break;
      case 2:
        items.push_back(Tensor(name, DType::kI64, {}));
        break;
      default:
        items.push_back(Tensor(name, DType::kU8, {0, 2, std::int64_t(rng() % 70)}));
        break;
    }
  }
  return items;
}

// Gives some of `items` what format 3 adds: a box of a global tensor (with block checksums of
// a small block size, so that items have several), a replicated layout, or a for_rank.
std::vector<ShardItem> WithFormat3(std::vector<ShardItem> items, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& item : items) {
    if (item.kind == ItemKind::kBlob) {
      if (rng() % 2) item.for_rank = rng() % 8;
      continue;
    }
    switch (rng() % 4) {
      case 0: {
        GlobalLayout l;
        l.global_name = "g\"lobal." + std::to_string(rng());  // a name JSON escapes
        for (auto d : item.shape) {
          const std::int64_t off = rng() % 3;
          l.offsets.push_back(off);
          l.global_shape.push_back(d + off + std::int64_t(rng() % 2));
        }
        Status resolved = ResolveLayout(item.name, item.shape, &l);
        INFO(resolved.message());
        REQUIRE(resolved.ok());
        item.layout = l;
        item.blocks.block_bytes = kMinBlockBytes;
        break;
      }
      case 1: {
        GlobalLayout l;
        l.global_name = "replicated." + std::to_string(rng());
        l.replicated = true;
        Status resolved = ResolveLayout(item.name, item.shape, &l);
        INFO(resolved.message());
        REQUIRE(resolved.ok());
        item.layout = l;
        break;
      }
      case 2:
        item.blocks.block_bytes = kMinBlockBytes;  // blocks without a layout are stored too
        break;
      default:
        break;
    }
  }
  return items;
}

void SetChecksums(std::vector<ShardItem>& items, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& item : items) {
    item.checksum = rng();
    for (auto& sum : item.blocks.sums) sum = rng();
  }
  if (!items.empty()) items.front().checksum = 0;  // all zero digits, as the placeholders
}

// Plans and renders `tensors` + `blobs` both ways and checks that they agree.
void CheckSameHeader(const ShardMeta& meta, const std::shared_ptr<const TensorPlan>& plan,
                     const std::vector<ShardItem>& blobs, std::uint64_t checksum_seed) {
  std::vector<ShardItem> all = plan->items();
  all.insert(all.end(), blobs.begin(), blobs.end());
  auto whole = ShardLayout::Plan(meta, all);
  REQUIRE(whole.ok());
  ShardLayout fast = ShardLayout::Unplanned(meta, plan, blobs);
  REQUIRE(fast.PlanInPlace().ok());
  CHECK(fast.header_bytes() == whole->header_bytes());
  CHECK(fast.data_bytes() == whole->data_bytes());
  REQUIRE(fast.items().size() == whole->items().size());
  for (std::size_t i = 0; i < all.size(); ++i) CHECK(fast.items()[i].offset == whole->items()[i].offset);

  // The placeholders, as at planning, then the checksums a version gets.
  CHECK(fast.RenderHeader() == whole->RenderHeader());
  SetChecksums(whole->items(), checksum_seed);
  SetChecksums(fast.items(), checksum_seed);
  const std::string header = fast.RenderHeader();
  REQUIRE(header == whole->RenderHeader());
  auto parsed = ParseShardHeader(std::string_view(header).substr(8), header.size() + fast.data_bytes());
  INFO(parsed.status().message());
  REQUIRE(parsed.ok());
  CHECK(parsed->meta.version == meta.version);
  CHECK(parsed->meta.session == meta.session);
  REQUIRE(parsed->items.size() == all.size());
  // By key: empty items share an offset, so the parsed order may differ among them.
  std::map<std::string, const ShardItem*> parsed_by_key;
  for (const auto& item : parsed->items) parsed_by_key[item.TensorKey()] = &item;
  REQUIRE(parsed_by_key.size() == all.size());
  bool format3 = false;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const ShardItem& want = fast.items()[i];
    REQUIRE(parsed_by_key.count(want.TensorKey()) == 1);
    const ShardItem& got = *parsed_by_key[want.TensorKey()];
    format3 = format3 || want.NeedsFormat3();
    CHECK(got.checksum == want.checksum);
    CHECK(got.layout == want.layout);
    CHECK(got.blocks.block_bytes == want.blocks.block_bytes);
    CHECK(got.blocks.sums == want.blocks.sums);
    CHECK(got.for_rank == want.for_rank);
  }
  CHECK(parsed->format_version == (format3 ? "3" : "2"));
}

}  // namespace

TEST_CASE("a header rendered from a TensorPlan has the bytes of one rendered from all items", "[format]") {
  const ShardMeta plain{"job-1", 42, 3, 8, ""};
  const ShardMeta with_session{"job \"two\"", 9999999999999999999ull, 0, 1, "sess-9/3"};
  for (std::size_t n : {0, 1, 2, 7, 60, 1000, 3000}) {
    INFO(n << " tensors");
    auto plan = TensorPlan::Make(ManyTensors(n, static_cast<std::uint32_t>(n)));
    REQUIRE(plan.ok());
    for (const ShardMeta& meta : {plain, with_session}) {
      INFO("session '" << meta.session << "'");
      CheckSameHeader(meta, plan.value(), {}, 1);
      // Blob keys sort among the tensors ("__blob__/" sits between "_" and "__blob<i>").
      CheckSameHeader(meta, plan.value(), {Blob("rng", 33), Blob("a\"b", 0), Blob("zz", 4100)}, 2);
      CheckSameHeader(meta, plan.value(), {Blob("only", 1)}, 3);
    }
  }
}

TEST_CASE("a TensorPlan with layouts, block checksums and for_rank renders like a whole layout", "[format]") {
  const ShardMeta meta{"job-3", 7, 5, 8, "s"};
  for (std::size_t n : {1, 2, 7, 60, 700}) {
    INFO(n << " tensors");
    auto plan =
        TensorPlan::Make(WithFormat3(ManyTensors(n, static_cast<std::uint32_t>(n), /*widen=*/300), 1));
    REQUIRE(plan.ok());
    CheckSameHeader(meta, plan.value(), {}, 1);
    CheckSameHeader(meta, plan.value(), WithFormat3({Blob("rng", 33), Blob("a\"b", 0), Blob("zz", 4100)}, 2),
                    2);
  }
  // Tensors without any, blobs with a for_rank: the blobs alone make the shard format 3.
  auto plain = TensorPlan::Make(ManyTensors(50, 4));
  REQUIRE(plain.ok());
  std::vector<ShardItem> blobs = {Blob("for-3", 10)};
  blobs[0].for_rank = 3;
  CheckSameHeader(meta, plain.value(), blobs, 4);
}

TEST_CASE("versions of one TensorPlan and of a re-registration render like whole layouts", "[format]") {
  auto gen1 = TensorPlan::Make(ManyTensors(500, 7));
  REQUIRE(gen1.ok());
  for (std::uint64_t v = 1; v <= 4; ++v) {
    std::vector<ShardItem> blobs;
    for (std::uint64_t b = 0; b < v; ++b) blobs.push_back(Blob("state" + std::to_string(b), 100 * v + b));
    CheckSameHeader(ShardMeta{"j", v, 1, 2, "s" + std::to_string(v)}, gen1.value(), blobs, v);
  }
  // The same names with other shapes (a re-registration): new offsets, new entries.
  auto gen2 = TensorPlan::Make(ManyTensors(500, 7, /*widen=*/5));
  REQUIRE(gen2.ok());
  CHECK(gen2.value()->data_bytes() != gen1.value()->data_bytes());
  CheckSameHeader(ShardMeta{"j", 5, 1, 2, "s5"}, gen2.value(), {Blob("state0", 9)}, 5);
}

TEST_CASE("a TensorPlan and the blobs after it are checked like a whole layout", "[format]") {
  auto dup = TensorPlan::Make({Tensor("w", DType::kU8, {1}), Tensor("w", DType::kF32, {1})});
  REQUIRE(dup.status().code() == StatusCode::kAlreadyExists);
  CHECK_THAT(dup.status().message(), Catch::Contains("'w'"));
  ShardItem bad = Tensor("w", DType::kF32, {3});
  bad.length = 13;
  CHECK(TensorPlan::Make({bad}).status().code() == StatusCode::kInvalidArgument);

  auto plan = TensorPlan::Make({Tensor("state", DType::kU8, {1}), Tensor("x", DType::kU8, {2})});
  REQUIRE(plan.ok());
  ShardLayout shares_name =
      ShardLayout::Unplanned(ShardMeta{"j", 1, 0, 1, ""}, plan.value(), {Blob("state", 3)});
  Status s = shares_name.PlanInPlace();
  CHECK(s.code() == StatusCode::kAlreadyExists);
  CHECK_THAT(s.message(), Catch::Contains("'state'"));
  CHECK_FALSE(shares_name.planned());
  ShardLayout two_blobs =
      ShardLayout::Unplanned(ShardMeta{"j", 1, 0, 1, ""}, plan.value(), {Blob("b", 3), Blob("b", 1)});
  CHECK(two_blobs.PlanInPlace().code() == StatusCode::kAlreadyExists);
}

TEST_CASE("shards of one TensorSet share its plan and render the whole layout's header", "[format]") {
  auto tensors = std::make_shared<TensorSet>();
  tensors->items = ManyTensors(200, 11);
  for (const auto& item : tensors->items) tensors->bytes += item.length;
  tensors->sources.resize(tensors->items.size());
  auto first = tensors->Plan();
  auto again = tensors->Plan();
  REQUIRE(first.ok());
  REQUIRE(again.ok());
  CHECK(first.value() == again.value());  // planned once

  for (std::uint64_t v : {3, 4}) {
    ShardMeta meta{"job", v, 0, 1, "reg"};
    std::vector<ShardItem> blobs = {Blob("extra", 10 + v)};
    std::vector<ItemSource> blob_sources(1);
    blob_sources[0].blob = std::make_shared<const std::string>(10 + v, 'x');
    ShardJob shard(meta, tensors, blobs, blob_sources, ShardPlacement{});
    REQUIRE(shard.Prepare().ok());
    CHECK(shard.sources().size() == tensors->items.size() + 1);
    std::vector<ShardItem> all = tensors->items;
    all.insert(all.end(), blobs.begin(), blobs.end());
    auto whole = ShardLayout::Plan(meta, all);
    REQUIRE(whole.ok());
    SetChecksums(whole->items(), v);
    SetChecksums(shard.layout().items(), v);
    CHECK(shard.layout().RenderHeader() == whole->RenderHeader());
    CHECK(shard.data_bytes() == whole->data_bytes());
  }

  auto broken = std::make_shared<TensorSet>();
  broken->items = {Tensor("w", DType::kU8, {1}), Tensor("w", DType::kU8, {1})};
  broken->sources.resize(2);
  ShardJob shard(ShardMeta{"job", 1, 0, 1, ""}, broken, {}, {}, ShardPlacement{});
  CHECK(shard.Prepare().code() == StatusCode::kAlreadyExists);
  CHECK(broken->Plan().status().code() == StatusCode::kAlreadyExists);
}
