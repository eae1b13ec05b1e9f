// Global layouts of items: where a tensor item sits in a tensor that spans ranks, and the
// per-block checksums that let a reader verify a part of an item.
//
// A tensor item may declare that it is the box [offsets, offsets + shape) of a global tensor
// (the way DCP's chunk metadata does it), or that it is replicated: every rank that declares
// it holds the whole global tensor, and one copy is enough. An item without a layout is
// rank-private. In a shard (format 3, see format/shard_format.h) the layout is
//   __metadata__["ckpt.layout.<item>"] = {"global":"<name>","shape":[..],"offsets":[..]}
//                                     or {"global":"<name>","replicated":true}
// (compact JSON, keys in this order when written; readers take any order, no other key),
// and a tensor with a non-replicated layout carries the xxh3-64 of each consecutive block of
// its bytes (the last block shorter; an empty item has none):
//   __metadata__["ckpt.blocks.<item>"] = "<block bytes> <16 hex><16 hex>..."
// so that a reader of part of the item (a restore at another world size) verifies just the
// blocks it reads. A blob written for one rank only carries
//   __metadata__["ckpt.for_rank.<blob>"] = "<rank>"      (decimal, below the world size)
// Everything here is pure (no I/O) and thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ckpt {

inline constexpr std::string_view kLayoutKeyPrefix = "ckpt.layout.";
inline constexpr std::string_view kBlocksKeyPrefix = "ckpt.blocks.";
inline constexpr std::string_view kForRankKeyPrefix = "ckpt.for_rank.";
// The block size the daemon writes. Readers take any size from 4 KiB to 1 GiB.
inline constexpr std::uint64_t kBlockBytes = std::uint64_t{1} << 20;
inline constexpr std::uint64_t kMinBlockBytes = 4096;
inline constexpr std::uint64_t kMaxBlockBytes = std::uint64_t{1} << 30;

// Where a tensor item sits in its global tensor. Resolved (ResolveLayout): global_name is
// never empty, and a replicated layout has global_shape = the item's shape and offsets 0.
struct GlobalLayout {
  std::string global_name;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> offsets;
  bool replicated = false;

  bool operator==(const GlobalLayout&) const = default;
};

// Checks a layout an item of `item_name` and `shape` declares and resolves it: an empty
// global name becomes the item's name; a replicated one gets the item's shape as its global
// shape (an empty global shape means that; another is an error) and zero offsets (given
// offsets must be zero). A non-replicated layout needs as many offsets and global
// dimensions as the item has dimensions, offsets >= 0 and offsets + shape <= global shape.
// InvalidArgument naming the item and what is wrong.
Status ResolveLayout(std::string_view item_name, const std::vector<std::int64_t>& shape,
                     GlobalLayout* layout);

// The compact JSON of a resolved layout, as stored under ckpt.layout.<item>.
std::string EncodeLayout(const GlobalLayout& layout);
// Parses a stored layout (DataLoss saying what is malformed). The result still has to be
// checked against its item (ResolveLayout); a replicated one comes back with an empty
// global shape and no offsets.
Result<GlobalLayout> DecodeLayout(std::string_view json);

// Per-block checksums of one item.
struct BlockSums {
  std::uint64_t block_bytes = 0;  // 0: the item has none
  std::vector<std::uint64_t> sums;
};

// The number of blocks of an item of `length` bytes.
std::uint64_t BlockCount(std::uint64_t length, std::uint64_t block_bytes);
// The sums of the consecutive blocks of `len` bytes at `p`.
std::vector<std::uint64_t> ComputeBlockSums(const char* p, std::uint64_t len, std::uint64_t block_bytes);
// "<block bytes> <16 hex>...", as stored under ckpt.blocks.<item>.
std::string EncodeBlockSums(const BlockSums& blocks);
// Parses a stored value for an item of `item_length` bytes: the block size in range, one
// well-formed sum per block. DataLoss otherwise.
Result<BlockSums> DecodeBlockSums(std::string_view text, std::uint64_t item_length);

// The part of an item a reader must read to verify the bytes [begin, end) of it: whole
// blocks, from a block boundary to a block boundary or the item's end.
struct BlockSpan {
  std::uint64_t first_block = 0;
  std::uint64_t end_block = 0;  // one past the last
  std::uint64_t begin = 0;      // byte offsets in the item
  std::uint64_t end = 0;
};
// `begin <= end <= item_length`, `block_bytes > 0`.
BlockSpan BlocksCovering(std::uint64_t begin, std::uint64_t end, std::uint64_t item_length,
                         std::uint64_t block_bytes);
// Verifies `len` bytes at `data`, the item's bytes from `begin` on, against `blocks` of an
// item of `item_length` bytes: `begin` must be a block boundary and `begin + len` one too or
// the item's end (what BlocksCovering gives). DataLoss naming `what` (the item, file and
// rank, as the caller words it), the block and both sums at the first mismatch;
// InvalidArgument for a range that is not whole blocks.
Status VerifyBlocks(const BlockSums& blocks, std::uint64_t item_length, std::uint64_t begin, const char* data,
                    std::uint64_t len, std::string_view what);

// A blob's ckpt.for_rank.<blob> value.
std::string EncodeForRank(std::uint32_t rank);
// Parses it for a shard of `world_size` ranks: decimal, canonical, below the world size.
Result<std::uint32_t> DecodeForRank(std::string_view text, std::uint32_t world_size);

}  // namespace ckpt
