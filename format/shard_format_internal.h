// What the writer (shard_layout.cc) and the reader (shard_reader.cc) of the shard file
// (format/shard_format.h) share: the words and the checks both apply to an item, and the
// lines of HeaderDigestText, which the writer also assembles piece by piece. Not part of
// shard_format.h's interface.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "format/shard_format.h"

namespace ckpt::shard_internal {

// Where a rendering has no block checksums to patch in.
inline constexpr std::size_t kNoBlocks = std::string::npos;

// "blob" or "tensor", as ckpt.item.<name> and the digest text spell an item's kind.
std::string KindName(ItemKind k);

// True if an item from `first` on needs format 3.
bool AnyNeedsFormat3(const std::vector<ShardItem>& items, std::size_t first = 0);

// The first line of HeaderDigestText (format 4 when `base` is set).
std::string DigestIdentity(const ShardMeta& meta, bool format3, std::optional<std::uint64_t> base = std::nullopt);

// Appends one item's line of HeaderDigestText. Returns where its checksum's hex digits are;
// *blocks (if given) gets where its first block checksum's are (kNoBlocks: none).
std::size_t AppendDigestLine(std::string& out, const std::string& key, const ShardItem& item,
                             std::size_t* blocks = nullptr);

// What format 3 adds to an item, checked the same way for a plan and a parsed header: a
// tensor's layout fits its shape, its blocks are of a size readers take (planning sizes their
// sums), only blobs have a for_rank. InvalidArgument naming the item.
Status CheckFormat3Fields(ShardItem& item);

}  // namespace ckpt::shard_internal
