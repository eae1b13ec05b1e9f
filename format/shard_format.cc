// What both sides of the shard file share (format/shard_format.h): an item's key and shape
// check, the checks of format 3's fields, and the text the header checksum is taken of. The
// writer is shard_layout.cc, the reader shard_reader.cc.
#include "format/shard_format.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "common/names.h"
#include "format/checksum.h"
#include "format/shard_format_internal.h"

namespace ckpt {
namespace shard_internal {
namespace {

void AppendCounted(std::string& out, std::string_view text) {
  out += std::to_string(text.size());
  out += ':';
  out += text;
}

}  // namespace

std::string KindName(ItemKind k) { return k == ItemKind::kBlob ? "blob" : "tensor"; }

bool AnyNeedsFormat3(const std::vector<ShardItem>& items, std::size_t first) {
  for (std::size_t i = first; i < items.size(); ++i) {
    if (items[i].NeedsFormat3()) return true;
  }
  return false;
}

std::string DigestIdentity(const ShardMeta& meta, bool format3, std::optional<std::uint64_t> base) {
  std::string out = base ? "ckptd-shard-header 4 job "
                         : (format3 ? "ckptd-shard-header 3 job " : "ckptd-shard-header 2 job ");
  AppendCounted(out, meta.job);
  out += " version " + std::to_string(meta.version) + " rank " + std::to_string(meta.rank) + " world_size " +
         std::to_string(meta.world_size) + " session ";
  AppendCounted(out, meta.session);
  if (base) out += " base " + std::to_string(*base);
  out += '\n';
  return out;
}

std::size_t AppendDigestLine(std::string& out, const std::string& key, const ShardItem& item,
                             std::size_t* blocks) {
  out += "item ";
  AppendCounted(out, key);
  out += ' ' + KindName(item.kind) + ' ' + std::string(DTypeName(item.dtype)) + " [";
  for (std::size_t i = 0; i < item.shape.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(item.shape[i]);
  }
  if (item.in_base) {
    out += "] base " + std::to_string(item.length) + ' ';
  } else {
    out += "] " + std::to_string(item.offset) + ' ' + std::to_string(item.offset + item.length) + ' ';
  }
  const std::size_t hex = out.size();
  out += ChecksumHex(item.checksum);
  if (item.layout) {
    out += " layout ";
    AppendCounted(out, EncodeLayout(*item.layout));
  }
  if (item.for_rank) out += " for_rank " + std::to_string(*item.for_rank);
  if (blocks) *blocks = kNoBlocks;
  if (item.blocks.block_bytes != 0) {
    out += " blocks " + std::to_string(item.blocks.block_bytes) + ' ';
    if (blocks) *blocks = out.size();
    for (std::uint64_t sum : item.blocks.sums) out += ChecksumHex(sum);
  }
  out += '\n';
  return hex;
}

Status CheckFormat3Fields(ShardItem& item) {
  if (item.kind == ItemKind::kBlob) {
    if (item.layout || item.blocks.block_bytes != 0) {
      return InvalidArgument("blob " + QuoteName(item.name) +
                             " has a layout or block checksums (tensors only)");
    }
    return Status::Ok();
  }
  if (item.for_rank)
    return InvalidArgument("tensor " + QuoteName(item.name) + " has a for_rank (blobs only)");
  if (item.layout) {
    GlobalLayout resolved = *item.layout;
    if (Status s = ResolveLayout(item.name, item.shape, &resolved); !s.ok()) return s;
    if (!(resolved == *item.layout)) {
      return InvalidArgument("item " + QuoteName(item.name) + ": layout is not resolved (see ResolveLayout)");
    }
  }
  if (item.blocks.block_bytes != 0) {
    if (item.blocks.block_bytes < kMinBlockBytes || item.blocks.block_bytes > kMaxBlockBytes) {
      return InvalidArgument("item " + QuoteName(item.name) + ": block size " +
                             std::to_string(item.blocks.block_bytes) + " is out of range");
    }
    item.blocks.sums.resize(BlockCount(item.length, item.blocks.block_bytes));
  }
  return Status::Ok();
}

}  // namespace shard_internal

using shard_internal::AnyNeedsFormat3;
using shard_internal::AppendDigestLine;
using shard_internal::DigestIdentity;

std::string HeaderDigestText(const ShardMeta& meta, const std::vector<ShardItem>& items,
                             std::optional<std::uint64_t> base) {
  std::string out = DigestIdentity(meta, AnyNeedsFormat3(items), base);
  std::vector<std::pair<std::string, const ShardItem*>> keyed;
  keyed.reserve(items.size());
  for (const auto& item : items) keyed.emplace_back(item.TensorKey(), &item);
  std::sort(keyed.begin(), keyed.end());
  for (const auto& [key, item] : keyed) AppendDigestLine(out, key, *item);
  return out;
}

std::uint64_t HeaderChecksum(const ShardMeta& meta, const std::vector<ShardItem>& items,
                             std::optional<std::uint64_t> base) {
  const std::string text = HeaderDigestText(meta, items, base);
  return Checksum::Of(text.data(), text.size());
}

std::string ShardItem::TensorKey() const {
  return kind == ItemKind::kBlob ? std::string(kBlobPrefix) + name : name;
}

std::string ShapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status CheckItemShape(const ShardItem& item) {
  std::uint64_t elems = 1;
  for (auto d : item.shape) {
    if (d < 0) return InvalidArgument("item " + QuoteName(item.name) + " has a negative dimension");
    if (d != 0 && elems > UINT64_MAX / static_cast<std::uint64_t>(d)) {
      return InvalidArgument("item " + QuoteName(item.name) + " has a shape that overflows");
    }
    elems *= static_cast<std::uint64_t>(d);
  }
  std::uint64_t size = DTypeSize(item.dtype);
  if (elems > UINT64_MAX / size || elems * size != item.length) {
    return InvalidArgument("item " + QuoteName(item.name) + ": shape and dtype " +
                           std::string(DTypeName(item.dtype)) + " give " + std::to_string(elems) +
                           " elements, which does not match its " + std::to_string(item.length) + " bytes");
  }
  return Status::Ok();
}

}  // namespace ckpt
