// Differential shards (format 4): a version's shard holding only the items that changed since
// its base, the other items read from the base's shard of the same rank. Written by hand
// (RenderDifferentialHeader + data), so that the readers are tested against bytes the test
// controls: a base that is missing, damaged, of another rank, itself differential, or holding
// other bytes than the version recorded.
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/checksum.h"
#include "format/paths.h"
#include "format/shard_files.h"
#include "format/shard_format.h"
#include "support/byte_pattern.h"
#include "support/shard_items.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::Bytes;
using ckpt::test::TempDir;

namespace {

ShardMeta Meta(std::uint64_t version, std::uint32_t rank = 1) { return ShardMeta{"job-d", version, rank, 4, ""}; }

std::vector<ShardItem> Items() {
  return {test::TensorItem("frozen.weight", DType::kF32, {64, 16}), test::TensorItem("trained.weight", DType::kBF16, {40}),
          test::TensorItem("frozen.bias", DType::kF32, {16}), test::TensorItem("empty", DType::kF16, {0, 2}),
          test::BlobItem("rng", 21)};
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  REQUIRE(out.good());
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string ShardAt(const std::string& root, std::uint64_t version, std::uint32_t rank = 1) {
  return root + "/job-d/" + VersionDirName(version) + "/" + ShardFileName(rank);
}

// The bytes of each item of a version: items named "frozen.*" and "empty" keep seed 100+i in
// every version; the others change with the version.
std::vector<std::string> Data(std::uint64_t version, const std::vector<ShardItem>& items) {
  std::vector<std::string> data;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const bool frozen = items[i].name.starts_with("frozen") || items[i].name == "empty";
    data.push_back(Bytes(items[i].length, static_cast<std::uint32_t>(frozen ? 100 + i : version * 10 + i)));
  }
  return data;
}

// A full shard of `version`.
std::vector<ShardItem> WriteFull(const std::string& path, std::uint64_t version, std::uint32_t rank = 1) {
  auto layout = ShardLayout::Plan(Meta(version, rank), Items());
  REQUIRE(layout.ok());
  auto data = Data(version, layout->items());
  for (std::size_t i = 0; i < data.size(); ++i) layout->items()[i].checksum = Checksum::Of(data[i].data(), data[i].size());
  std::string file = layout->RenderHeader();
  for (const auto& d : data) file += d;
  WriteFile(path, file);
  return layout->items();
}

// A differential shard of `version` over `base`: the items whose bytes equal the base's are
// left to it.
std::vector<ShardItem> WriteDifferential(const std::string& path, std::uint64_t version, std::uint64_t base,
                                         std::uint32_t rank = 1) {
  auto items = Items();
  auto data = Data(version, items);
  auto base_data = Data(base, items);
  for (std::size_t i = 0; i < items.size(); ++i) {
    items[i].checksum = Checksum::Of(data[i].data(), data[i].size());
    items[i].in_base = data[i] == base_data[i];
  }
  std::uint64_t data_bytes = 0;
  auto header = RenderDifferentialHeader(Meta(version, rank), base, items, &data_bytes);
  REQUIRE(header.ok());
  std::string file = header.value();
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (!items[i].in_base) file += data[i];
  }
  REQUIRE(file.size() == header->size() + data_bytes);
  WriteFile(path, file);
  return items;
}

// Every item of the shard at `path`, read through ShardFiles, by name.
std::map<std::string, std::string> ReadItems(const ShardFiles& files) {
  std::map<std::string, std::string> out;
  for (std::size_t i = 0; i < files.info().items.size(); ++i) {
    const ShardItem& item = files.info().items[i];
    std::string bytes(item.length, '\0');
    REQUIRE(files.Read(i, 0, bytes.data(), bytes.size()).ok());
    out[item.name] = bytes;
  }
  return out;
}

// Rewrites the JSON header of the shard at `path` through `edit`, keeping its padded size.
template <typename Edit>
void EditHeader(const std::string& path, Edit edit) {
  std::string file = ReadAll(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  auto json = nlohmann::json::parse(file.substr(8, n));
  edit(json);
  std::string text = json.dump();
  REQUIRE(text.size() <= n);
  text.resize(n, ' ');
  file.replace(8, n, text);
  WriteFile(path, file);
}

}  // namespace

TEST_CASE("a differential shard holds only the changed items and reads back whole through its base",
          "[format][differential]") {
  TempDir dir;
  WriteFull(ShardAt(dir.path(), 10), 10);
  const auto written = WriteDifferential(ShardAt(dir.path(), 12), 12, 10);

  auto info = ReadShardHeader(ShardAt(dir.path(), 12));
  REQUIRE(info.ok());
  CHECK(info->format_version == "4");
  REQUIRE(info->base == std::optional<std::uint64_t>(10));
  CHECK(info->items.size() == written.size());
  std::uint64_t stored = 0, left = 0;
  for (const auto& item : info->items) (item.in_base ? left : stored) += item.length;
  CHECK(stored == 40 * 2 + 21);
  CHECK(left == 64 * 16 * 4 + 16 * 4);
  CHECK(info->file_bytes == info->data_start + stored);

  auto files = ShardFiles::Open(ShardAt(dir.path(), 12));
  REQUIRE(files.ok());
  CHECK(files->differential());
  CHECK(files->base_path() == ShardAt(dir.path(), 10));
  CHECK(files->stored_bytes() == stored);
  CHECK(files->item_bytes() == stored + left);
  auto items = ReadItems(files.value());
  auto want = Data(12, Items());
  for (std::size_t i = 0; i < Items().size(); ++i) CHECK(items[Items()[i].name] == want[i]);
  CHECK(VerifyShard(ShardAt(dir.path(), 12)).ok());

  // A full shard reads through ShardFiles as it always did.
  auto full = ShardFiles::Open(ShardAt(dir.path(), 10));
  REQUIRE(full.ok());
  CHECK_FALSE(full->differential());
  CHECK(ReadItems(full.value())["trained.weight"] == Data(10, Items())[1]);
}

TEST_CASE("the base of a differential shard is found beside its version directory, whatever the path's form",
          "[format][differential]") {
  CHECK(ShardFiles::BasePath("/r/job/v0000000012/rank-00001.safetensors", 10) ==
        "/r/job/v0000000010/rank-00001.safetensors");
  CHECK(ShardFiles::BasePath("job/v0000000012/rank-00001.safetensors", 10) ==
        "job/v0000000010/rank-00001.safetensors");
  // A version a rollback set aside, under its number or as the second one of that number.
  CHECK(ShardFiles::BasePath("/r/job/set-aside/v0000000012/rank-00001.safetensors", 10) ==
        "/r/job/set-aside/v0000000010/rank-00001.safetensors");
  CHECK(ShardFiles::BasePath("/r/job/set-aside/v0000000012.1/rank-00001.safetensors", 10) ==
        "/r/job/set-aside/v0000000010/rank-00001.safetensors");
  // Run from inside the version directory.
  CHECK(ShardFiles::BasePath("rank-00001.safetensors", 10) == "./../v0000000010/rank-00001.safetensors");
  CHECK(ShardFiles::BasePath("./rank-00001.safetensors", 10) == "./../v0000000010/rank-00001.safetensors");
}

TEST_CASE("a standard safetensors reading of a differential shard sees only the changed items, under their names",
          "[format][differential]") {
  TempDir dir;
  WriteFull(ShardAt(dir.path(), 10), 10);
  WriteDifferential(ShardAt(dir.path(), 11), 11, 10);
  const std::string file = ReadAll(ShardAt(dir.path(), 11));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  CHECK((8 + n) % 4096 == 0);
  auto json = nlohmann::json::parse(file.substr(8, n));
  std::vector<std::string> tensors;
  std::uint64_t end = 0;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    tensors.push_back(it.key());
    end = std::max<std::uint64_t>(end, it.value()["data_offsets"][1].get<std::uint64_t>());
  }
  std::sort(tensors.begin(), tensors.end());
  CHECK(tensors == std::vector<std::string>{"__blob__/rng", "trained.weight"});
  CHECK(8 + n + end == file.size());
  CHECK(json["__metadata__"]["ckpt.base"] == "10");
  CHECK(json["__metadata__"]["ckpt.ref.frozen.weight"] == "F32 [64,16]");
  CHECK(json["__metadata__"]["ckpt.ref.empty"] == "F16 [0,2]");
}

TEST_CASE("a differential shard whose base is missing, damaged or another shard is data loss naming both files",
          "[format][differential]") {
  TempDir dir;
  const std::string base = ShardAt(dir.path(), 10);
  const std::string diff = ShardAt(dir.path(), 12);

  SECTION("base missing") {
    WriteDifferential(diff, 12, 10);
    auto files = ShardFiles::Open(diff);
    REQUIRE(files.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(files.status().message(), Catch::Contains(diff) && Catch::Contains(base) &&
                                             Catch::Contains("cannot be read"));
    CHECK(VerifyShard(diff).code() == StatusCode::kDataLoss);
  }
  SECTION("base of another rank") {
    WriteFull(base, 10, /*rank=*/2);
    WriteDifferential(diff, 12, 10);
    auto files = ShardFiles::Open(diff);
    REQUIRE(files.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(files.status().message(), Catch::Contains("rank 2"));
  }
  SECTION("base of another version") {
    WriteFull(base, 9);
    WriteDifferential(diff, 12, 10);
    CHECK_THAT(ShardFiles::Open(diff).status().message(), Catch::Contains("version 9"));
  }
  SECTION("base that is itself differential") {
    WriteFull(ShardAt(dir.path(), 8), 8);
    WriteDifferential(base, 10, 8);
    WriteDifferential(diff, 12, 10);
    CHECK_THAT(ShardFiles::Open(diff).status().message(), Catch::Contains("itself differential"));
  }
  SECTION("base whose unchanged item holds other bytes than the version recorded") {
    // A base of another run: same names and shapes, other bytes, hence other checksums.
    WriteFull(base, 10);
    WriteDifferential(diff, 12, 10);
    std::string file = ReadAll(base);
    auto info = ReadShardHeader(base);
    REQUIRE(info.ok());
    // Flip a byte of frozen.weight and fix its checksums, as a rewritten base would have.
    const ShardItem* frozen = nullptr;
    for (const auto& item : info->items)
      if (item.name == "frozen.weight") frozen = &item;
    REQUIRE(frozen != nullptr);
    file[info->data_start + frozen->offset] ^= 0x5a;
    std::vector<ShardItem> fixed = info->items;
    for (auto& item : fixed)
      if (item.name == "frozen.weight")
        item.checksum = Checksum::Of(file.data() + info->data_start + item.offset, item.length);
    auto relaid = ShardLayout::Plan(info->meta, fixed);
    REQUIRE(relaid.ok());
    for (std::size_t i = 0; i < fixed.size(); ++i) relaid->items()[i].checksum = fixed[i].checksum;
    const std::string header = relaid->RenderHeader();
    REQUIRE(header.size() == info->data_start);
    file.replace(0, header.size(), header);
    WriteFile(base, file);
    REQUIRE(VerifyShard(base).ok());  // the base is a sound shard of its own
    auto files = ShardFiles::Open(diff);
    REQUIRE(files.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(files.status().message(),
               Catch::Contains("frozen.weight") && Catch::Contains("is not the one the version recorded"));
  }
  SECTION("base whose bytes were damaged after it was written") {
    WriteFull(base, 10);
    WriteDifferential(diff, 12, 10);
    auto info = ReadShardHeader(base);
    REQUIRE(info.ok());
    std::string file = ReadAll(base);
    file[info->data_start + 5] ^= 0x01;  // in frozen.weight, the first item
    WriteFile(base, file);
    const Status s = VerifyShard(diff);
    REQUIRE(s.code() == StatusCode::kDataLoss);
    CHECK_THAT(s.message(), Catch::Contains(base) && Catch::Contains("frozen.weight") &&
                                Catch::Contains("read from the base of " + diff));
  }
}

TEST_CASE("the header checksum of a differential shard covers its base and what it leaves there",
          "[format][differential]") {
  TempDir dir;
  WriteFull(ShardAt(dir.path(), 10), 10);
  WriteFull(ShardAt(dir.path(), 9), 9);
  const std::string diff = ShardAt(dir.path(), 12);
  WriteDifferential(diff, 12, 10);
  SECTION("another base") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"]["ckpt.base"] = "9"; });
  }
  SECTION("another shape for an item left to the base") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"]["ckpt.ref.frozen.weight"] = "F32 [16,64]"; });
  }
  SECTION("an item dropped from the shard") {
    EditHeader(diff, [](nlohmann::json& h) {
      h["__metadata__"].erase("ckpt.ref.frozen.bias");
      h["__metadata__"].erase("ckpt.item.frozen.bias");
    });
  }
  const Status s = ReadShardHeader(diff).status();
  REQUIRE(s.code() == StatusCode::kDataLoss);
  CHECK_THAT(s.message(), Catch::Contains("header checksum mismatch"));
}

TEST_CASE("differential keys are refused where they do not belong", "[format][differential]") {
  TempDir dir;
  const std::string full = ShardAt(dir.path(), 10);
  WriteFull(full, 10);
  const std::string diff = ShardAt(dir.path(), 12);
  WriteDifferential(diff, 12, 10);
  SECTION("a ckpt.ref key in a full shard") {
    EditHeader(full, [](nlohmann::json& h) { h["__metadata__"]["ckpt.ref.x"] = "U8 [1]"; });
    CHECK_THAT(ReadShardHeader(full).status().message(), Catch::Contains("only format 4 has"));
  }
  SECTION("a ckpt.base in a full shard") {
    EditHeader(full, [](nlohmann::json& h) { h["__metadata__"]["ckpt.base"] = "3"; });
    CHECK_THAT(ReadShardHeader(full).status().message(), Catch::Contains("only format 4 has"));
  }
  SECTION("a base that is not earlier") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"]["ckpt.base"] = "12"; });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("not an earlier version"));
  }
  SECTION("no base") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"].erase("ckpt.base"); });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("lacks ckpt.base"));
  }
  SECTION("a malformed reference") {
    for (const char* bad : {"F32", "F32 [64,x]", "Q9 [1]", "F32 [99999999999999999999]", "F32 64,16"}) {
      EditHeader(diff, [&](nlohmann::json& h) { h["__metadata__"]["ckpt.ref.frozen.weight"] = bad; });
      CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("is malformed"));
    }
  }
  SECTION("a reference that is not a string") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"]["ckpt.ref.frozen.weight"] = 7; });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("not a string"));
  }
  SECTION("a blob left to the base as anything but U8 [length]") {
    EditHeader(diff, [](nlohmann::json& h) {
      h["__metadata__"]["ckpt.ref.frozen.bias"] = "U8 [64]";
      h["__metadata__"]["ckpt.item.frozen.bias"] = std::string("kind=blob xxh3=0000000000000000");
      h["__metadata__"]["ckpt.ref.frozen.weight"] = "F32 [4096]";
      h["__metadata__"]["ckpt.item.frozen.weight"] = std::string("kind=blob xxh3=0000000000000000");
    });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("blob's bytes are not"));
  }
  SECTION("a reference without its checksum") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"].erase("ckpt.item.frozen.weight"); });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("no checksum for"));
  }
  SECTION("an item both stored and left to the base") {
    EditHeader(diff, [](nlohmann::json& h) { h["__metadata__"]["ckpt.ref.trained.weight"] = "BF16 [40]"; });
    CHECK_THAT(ReadShardHeader(diff).status().message(), Catch::Contains("both stored in the shard and left"));
  }
  SECTION("RenderDifferentialHeader refuses a base that is not earlier") {
    auto items = Items();
    std::uint64_t bytes = 0;
    CHECK(RenderDifferentialHeader(Meta(12), 12, items, &bytes).status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("a differential shard with every item unchanged holds no data and reads back whole",
          "[format][differential]") {
  TempDir dir;
  WriteFull(ShardAt(dir.path(), 10), 10);
  auto base = ReadShardHeader(ShardAt(dir.path(), 10));
  REQUIRE(base.ok());
  std::vector<ShardItem> items = base->items;
  for (auto& item : items) item.in_base = true;
  std::uint64_t bytes = 1;
  ShardMeta meta = Meta(11);
  auto header = RenderDifferentialHeader(meta, 10, items, &bytes);
  REQUIRE(header.ok());
  CHECK(bytes == 0);
  WriteFile(ShardAt(dir.path(), 11), header.value());
  CHECK(VerifyShard(ShardAt(dir.path(), 11)).ok());
  auto files = ShardFiles::Open(ShardAt(dir.path(), 11));
  REQUIRE(files.ok());
  CHECK(files->stored_bytes() == 0);
  auto got = ReadItems(files.value());
  auto want = Data(10, Items());
  for (std::size_t i = 0; i < Items().size(); ++i) CHECK(got[Items()[i].name] == want[i]);
}
