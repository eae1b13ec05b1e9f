#include "format/global_layout.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/names.h"
#include "format/checksum.h"

namespace ckpt {
namespace {

using Json = nlohmann::json;

std::string Dims(const std::vector<std::int64_t>& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

Status Bad(std::string_view item_name, const std::string& what) {
  return InvalidArgument("item " + QuoteName(item_name) + ": layout " + what);
}

// Parses a JSON array of non-negative integers that fit int64.
bool ParseDims(const Json& j, std::vector<std::int64_t>* out) {
  if (!j.is_array()) return false;
  out->clear();
  for (const auto& d : j) {
    if (!d.is_number_unsigned()) return false;
    const std::uint64_t v = d.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(INT64_MAX)) return false;
    out->push_back(static_cast<std::int64_t>(v));
  }
  return true;
}

}  // namespace

Status ResolveLayout(std::string_view item_name, const std::vector<std::int64_t>& shape,
                     GlobalLayout* layout) {
  if (layout->global_name.empty()) layout->global_name = std::string(item_name);
  if (std::string err = CheckItemName(layout->global_name); !err.empty()) {
    return Bad(item_name, "global name: " + err);
  }
  if (layout->replicated) {
    if (!layout->global_shape.empty() && layout->global_shape != shape) {
      return Bad(item_name, "is replicated but its global shape " + Dims(layout->global_shape) +
                                " is not the item's shape " + Dims(shape));
    }
    if (!layout->offsets.empty() &&
        (layout->offsets.size() != shape.size() || std::any_of(layout->offsets.begin(), layout->offsets.end(),
                                                               [](std::int64_t o) { return o != 0; }))) {
      return Bad(item_name,
                 "is replicated but has offsets " + Dims(layout->offsets) + " (must be empty or 0)");
    }
    layout->global_shape = shape;
    layout->offsets.assign(shape.size(), 0);
    return Status::Ok();
  }
  if (layout->global_shape.size() != shape.size() || layout->offsets.size() != shape.size()) {
    return Bad(item_name, "has global shape " + Dims(layout->global_shape) + " and offsets " +
                              Dims(layout->offsets) + " for an item of " + std::to_string(shape.size()) +
                              " dimensions " + Dims(shape) + " (each needs one entry per dimension)");
  }
  std::uint64_t elems = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const std::int64_t g = layout->global_shape[d];
    const std::int64_t o = layout->offsets[d];
    if (g < 0 || o < 0) {
      return Bad(item_name, "has a negative global dimension or offset (global shape " +
                                Dims(layout->global_shape) + ", offsets " + Dims(layout->offsets) + ")");
    }
    if (shape[d] > g || o > g - shape[d]) {
      return Bad(item_name, "box offsets " + Dims(layout->offsets) + " + shape " + Dims(shape) +
                                " does not fit the global shape " + Dims(layout->global_shape) +
                                " in dimension " + std::to_string(d));
    }
    const auto ug = static_cast<std::uint64_t>(g);
    if (ug != 0 && elems > UINT64_MAX / ug) return Bad(item_name, "has a global shape that overflows");
    elems *= ug;
  }
  return Status::Ok();
}

std::string EncodeLayout(const GlobalLayout& layout) {
  std::string out = "{\"global\":" + Json(layout.global_name).dump();
  if (layout.replicated) return out + ",\"replicated\":true}";
  return out + ",\"shape\":" + Dims(layout.global_shape) + ",\"offsets\":" + Dims(layout.offsets) + "}";
}

Result<GlobalLayout> DecodeLayout(std::string_view text) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return DataLoss("layout is not a JSON object");
  GlobalLayout layout;
  bool has_shape = false, has_offsets = false, has_global = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "global") {
      if (!it->is_string()) return DataLoss("layout's global name is not a string");
      layout.global_name = it->get<std::string>();
      has_global = true;
    } else if (key == "replicated") {
      if (!it->is_boolean() || !it->get<bool>()) return DataLoss("layout's replicated is not true");
      layout.replicated = true;
    } else if (key == "shape") {
      if (!ParseDims(*it, &layout.global_shape)) {
        return DataLoss("layout's shape is not an array of non-negative integers");
      }
      has_shape = true;
    } else if (key == "offsets") {
      if (!ParseDims(*it, &layout.offsets)) {
        return DataLoss("layout's offsets are not an array of non-negative integers");
      }
      has_offsets = true;
    } else {
      return DataLoss("layout has an unknown key " + QuoteName(key));
    }
  }
  if (!has_global) return DataLoss("layout has no global name");
  if (std::string err = CheckItemName(layout.global_name); !err.empty()) {
    return DataLoss("layout's global name: " + err);
  }
  if (layout.replicated ? (has_shape || has_offsets) : !(has_shape && has_offsets)) {
    return DataLoss(layout.replicated ? "replicated layout has a shape or offsets"
                                      : "layout lacks its shape or offsets");
  }
  return layout;
}

std::uint64_t BlockCount(std::uint64_t length, std::uint64_t block_bytes) {
  return length / block_bytes + (length % block_bytes != 0 ? 1 : 0);
}

std::vector<std::uint64_t> ComputeBlockSums(const char* p, std::uint64_t len, std::uint64_t block_bytes) {
  std::vector<std::uint64_t> sums;
  sums.reserve(BlockCount(len, block_bytes));
  for (std::uint64_t at = 0; at < len; at += block_bytes) {
    sums.push_back(Checksum::Of(p + at, std::min(block_bytes, len - at)));
  }
  return sums;
}

std::string EncodeBlockSums(const BlockSums& blocks) {
  std::string out = std::to_string(blocks.block_bytes) + ' ';
  out.reserve(out.size() + 16 * blocks.sums.size());
  for (std::uint64_t s : blocks.sums) out += ChecksumHex(s);
  return out;
}

Result<BlockSums> DecodeBlockSums(std::string_view text, std::uint64_t item_length) {
  const std::size_t space = text.find(' ');
  if (space == std::string_view::npos || space == 0 || space > 10) {
    return DataLoss("block checksums do not start with a block size");
  }
  const std::string_view size = text.substr(0, space);
  if (size.find_first_not_of("0123456789") != std::string_view::npos || size[0] == '0') {
    return DataLoss("block checksums have a malformed block size");
  }
  BlockSums blocks;
  blocks.block_bytes = std::stoull(std::string(size));
  if (blocks.block_bytes < kMinBlockBytes || blocks.block_bytes > kMaxBlockBytes) {
    return DataLoss("block size " + std::to_string(blocks.block_bytes) + " is out of range");
  }
  const std::string_view hex = text.substr(space + 1);
  const std::uint64_t count = BlockCount(item_length, blocks.block_bytes);
  if (hex.size() != 16 * count) {
    return DataLoss("block checksums hold " + std::to_string(hex.size()) +
                    " hex digits, not 16 for each of " + std::to_string(count) + " blocks");
  }
  blocks.sums.resize(count);
  for (std::uint64_t b = 0; b < count; ++b) {
    if (!ParseChecksumHex(std::string(hex.substr(16 * b, 16)), &blocks.sums[b])) {
      return DataLoss("block checksum " + std::to_string(b) + " is malformed");
    }
  }
  return blocks;
}

BlockSpan BlocksCovering(std::uint64_t begin, std::uint64_t end, std::uint64_t item_length,
                         std::uint64_t block_bytes) {
  BlockSpan span;
  span.first_block = begin / block_bytes;
  span.end_block = end == begin ? span.first_block : BlockCount(end, block_bytes);
  span.begin = span.first_block * block_bytes;
  span.end = std::min(item_length, span.end_block * block_bytes);
  if (span.end < span.begin) span.end = span.begin;
  return span;
}

Status VerifyBlocks(const BlockSums& blocks, std::uint64_t item_length, std::uint64_t begin, const char* data,
                    std::uint64_t len, std::string_view what) {
  const std::uint64_t bs = blocks.block_bytes;
  if (bs == 0) return InvalidArgument(std::string(what) + " has no block checksums");
  if (begin % bs != 0 || begin > item_length || len > item_length - begin ||
      ((begin + len) % bs != 0 && begin + len != item_length)) {
    return InvalidArgument("bytes [" + std::to_string(begin) + ", " + std::to_string(begin + len) + ") of " +
                           std::string(what) + " are not whole blocks of " + std::to_string(bs) + " bytes");
  }
  for (std::uint64_t at = 0; at < len; at += bs) {
    const std::uint64_t block = (begin + at) / bs;
    if (block >= blocks.sums.size()) return InvalidArgument(std::string(what) + " has fewer block checksums");
    const std::uint64_t got = Checksum::Of(data + at, std::min(bs, len - at));
    if (got != blocks.sums[block]) {
      return DataLoss(std::string(what) + ": checksum mismatch in block " + std::to_string(block) +
                      " (bytes " + std::to_string(block * bs) + "-" +
                      std::to_string(std::min(item_length, (block + 1) * bs)) + " of the item; stored " +
                      ChecksumHex(blocks.sums[block]) + ", computed " + ChecksumHex(got) + ")");
    }
  }
  return Status::Ok();
}

std::string EncodeForRank(std::uint32_t rank) { return std::to_string(rank); }

Result<std::uint32_t> DecodeForRank(std::string_view text, std::uint32_t world_size) {
  if (text.empty() || text.size() > 10 || text.find_first_not_of("0123456789") != std::string_view::npos ||
      (text.size() > 1 && text[0] == '0')) {
    return DataLoss("for_rank '" + std::string(text.substr(0, 20)) + "' is not a rank");
  }
  const std::uint64_t r = std::stoull(std::string(text));
  if (r >= world_size) {
    return DataLoss("for_rank " + std::to_string(r) + " is not a rank of world size " +
                    std::to_string(world_size));
  }
  return static_cast<std::uint32_t>(r);
}

}  // namespace ckpt
