// Fuzz target: the per-version index parser (format/version_index.h), on an index.json as
// readers (restore at another world size, ckptctl export, Python) take it from a shared file
// system.
//
// Invariants checked on every index that parses:
//   - every chunk, private item and blob names a rank below the world size and that rank's
//     canonical shard file (nothing outside the version directory); every chunk is a box
//     within its tensor's shape, of its tensor's rank, and a replicated tensor's chunks are
//     the whole tensor;
//   - the index, rendered again by the writer (VersionIndex::Render), parses back to the same
//     index (what a reader accepts, the writer can say).
#include <cstdint>
#include <string_view>

#include "format/paths.h"
#include "format/version_index.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto index = ckpt::VersionIndex::Parse(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!index.ok()) {
    FUZZ_CHECK(index.status().code() == ckpt::StatusCode::kDataLoss, index.status().message().c_str());
    return 0;
  }
  const std::uint32_t world = index->world_size;
  FUZZ_CHECK(world > 0, "a world of ranks");
  for (const auto& [name, t] : index->tensors) {
    for (const auto& c : t.chunks) {
      FUZZ_CHECK(c.rank < world && c.file == ckpt::ShardFileName(c.rank), "chunk in its rank's shard");
      FUZZ_CHECK(c.offsets.size() == t.shape.size() && c.shape.size() == t.shape.size(),
                 "chunk of the tensor's rank");
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        FUZZ_CHECK(c.offsets[d] >= 0 && c.shape[d] >= 0 && c.shape[d] <= t.shape[d] &&
                       c.offsets[d] <= t.shape[d] - c.shape[d],
                   "chunk within its tensor");
        FUZZ_CHECK(!t.replicated || (c.offsets[d] == 0 && c.shape[d] == t.shape[d]),
                   "replicated chunk whole");
      }
    }
  }
  for (const auto& [rank, items] : index->private_items) {
    FUZZ_CHECK(rank < world, "private items of a rank");
    for (const auto& it : items)
      FUZZ_CHECK(it.file == ckpt::ShardFileName(rank), "private item in its shard");
  }
  for (const auto& b : index->blobs) {
    FUZZ_CHECK(b.rank < world && b.file == ckpt::ShardFileName(b.rank), "blob in its rank's shard");
    FUZZ_CHECK(!b.for_rank || *b.for_rank < world, "blob for a rank of the world");
  }
  auto again = ckpt::VersionIndex::Parse(index->Render());
  FUZZ_CHECK(again.ok(), again.status().message().c_str());
  FUZZ_CHECK(again.value() == index.value(), "index survives a render");
  return 0;
}
