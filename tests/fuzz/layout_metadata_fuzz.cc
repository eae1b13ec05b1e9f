// Fuzz target: the parsers of the metadata values of format 3 (format/global_layout.h), as
// ParseShardHeader applies them to ckpt.layout.<item>, ckpt.blocks.<item> and
// ckpt.for_rank.<item>. The first input byte picks the parser (and, for block checksums, the
// next 4 the item's length; for for_rank, the next 4 the world size); the rest is the value.
//
// Invariants:
//   - a layout that decodes has a valid global name, encodes and decodes back to itself,
//     and (not replicated) resolves against an item that is the whole global tensor (whether
//     it fits its own item is ResolveLayout's check in ParseShardHeader);
//   - block checksums that decode hold exactly one sum per block of the item, a block size in
//     range, and encode back to a text that decodes to the same;
//   - a for_rank that decodes is below the world size and encodes back to the same text.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common/names.h"
#include "format/global_layout.h"
#include "fuzz_check.h"

namespace {

std::uint32_t Word(const std::uint8_t* p) {
  std::uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  const std::uint8_t which = data[0] % 3;
  const std::uint32_t word = Word(data + 1);
  const std::string_view value(reinterpret_cast<const char*>(data + 5), size - 5);
  if (which == 0) {
    auto layout = ckpt::DecodeLayout(value);
    if (!layout.ok()) return 0;
    FUZZ_CHECK(ckpt::CheckItemName(layout->global_name).empty(), "a valid global name");
    auto again = ckpt::DecodeLayout(ckpt::EncodeLayout(layout.value()));
    FUZZ_CHECK(again.ok(), again.status().message().c_str());
    FUZZ_CHECK(again.value() == layout.value(), "layout survives an encode");
    // As ParseShardHeader does: resolved against an item of the box's shape (the global
    // shape itself), which always fits at offset 0.
    if (!layout->replicated) {
      ckpt::GlobalLayout at_zero = layout.value();
      at_zero.offsets.assign(at_zero.global_shape.size(), 0);
      ckpt::Status s = ckpt::ResolveLayout("item", at_zero.global_shape, &at_zero);
      FUZZ_CHECK(s.ok() || s.message().find("overflows") != std::string::npos, s.message().c_str());
    }
  } else if (which == 1) {
    const std::uint64_t length = word;  // items up to 4 GiB
    auto blocks = ckpt::DecodeBlockSums(value, length);
    if (!blocks.ok()) return 0;
    FUZZ_CHECK(blocks->block_bytes >= ckpt::kMinBlockBytes && blocks->block_bytes <= ckpt::kMaxBlockBytes,
               "block size in range");
    FUZZ_CHECK(blocks->sums.size() == ckpt::BlockCount(length, blocks->block_bytes), "one sum per block");
    auto again = ckpt::DecodeBlockSums(ckpt::EncodeBlockSums(blocks.value()), length);
    FUZZ_CHECK(again.ok(), again.status().message().c_str());
    FUZZ_CHECK(again->block_bytes == blocks->block_bytes && again->sums == blocks->sums,
               "blocks survive an encode");
  } else {
    const std::uint32_t world = word == 0 ? 1 : word;
    auto rank = ckpt::DecodeForRank(value, world);
    if (!rank.ok()) return 0;
    FUZZ_CHECK(rank.value() < world, "a rank of the world");
    FUZZ_CHECK(ckpt::EncodeForRank(rank.value()) == value, "for_rank is canonical");
  }
  return 0;
}
