// The writer of the shard file (format/shard_format.h): ShardLayout plans a shard (packs its
// items, sizes its header) and renders its header; TensorPlan does the part of that which
// every shard of one descriptor-table generation shares, once.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/align.h"
#include "common/names.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "format/shard_format_internal.h"

namespace ckpt {
namespace {

using shard_internal::AnyNeedsFormat3;
using shard_internal::AppendDigestLine;
using shard_internal::CheckFormat3Fields;
using shard_internal::DigestIdentity;
using shard_internal::KindName;
using shard_internal::kNoBlocks;

std::string ItemMeta(const ShardItem& item) {
  return "kind=" + KindName(item.kind) + " xxh3=" + ChecksumHex(item.checksum);
}

// Renders the header by hand: nlohmann's ordered_json inserts in linear time per key,
// which made headers of thousands of items cost tens of milliseconds.
void AppendString(std::string& out, std::string_view text) { out += nlohmann::json(text).dump(); }

// The identity fields of __metadata__ after the format version.
std::string RenderIdentityFields(const ShardMeta& meta) {
  std::string out;
  out += ",\"ckpt.job\":";
  AppendString(out, meta.job);
  out += ",\"ckpt.version\":\"" + std::to_string(meta.version) + "\"";
  out += ",\"ckpt.rank\":\"" + std::to_string(meta.rank) + "\"";
  out += ",\"ckpt.world_size\":\"" + std::to_string(meta.world_size) + "\"";
  if (!meta.session.empty()) {
    out += ",\"ckpt.session\":";
    AppendString(out, meta.session);
  }
  return out;
}

// The JSON from its opening brace to the last identity field of __metadata__.
std::string RenderIdentity(const ShardMeta& meta, bool format3) {
  std::string out = "{\"__metadata__\":{\"ckpt.format_version\":";
  AppendString(out, format3 ? kFormatVersionWithLayouts : kFormatVersion);
  return out + RenderIdentityFields(meta);
}

// Appends ,"ckpt.item.<name>":"kind=... xxh3=<16 hex>" and the item's keys of format 3.
// Returns where the checksum's hex digits are; *blocks (if given) gets where the first block
// checksum's are (kNoBlocks: none).
std::size_t AppendItemMeta(std::string& out, const ShardItem& item, std::size_t* blocks = nullptr) {
  out += ',';
  AppendString(out, "ckpt.item." + item.name);
  out += ':';
  AppendString(out, ItemMeta(item));
  const std::size_t hex = out.size() - 1 - 16;
  if (item.layout) {
    out += ',';
    AppendString(out, std::string(kLayoutKeyPrefix) + item.name);
    out += ':';
    AppendString(out, EncodeLayout(*item.layout));
  }
  if (item.for_rank) {
    out += ',';
    AppendString(out, std::string(kForRankKeyPrefix) + item.name);
    out += ":\"" + EncodeForRank(*item.for_rank) + "\"";
  }
  if (blocks) *blocks = kNoBlocks;
  if (item.blocks.block_bytes != 0) {
    out += ',';
    AppendString(out, std::string(kBlocksKeyPrefix) + item.name);
    out += ":\"" + std::to_string(item.blocks.block_bytes) + ' ';
    if (blocks) *blocks = out.size();
    out.reserve(out.size() + 16 * item.blocks.sums.size() + 1);
    for (std::uint64_t sum : item.blocks.sums) out += ChecksumHex(sum);
    out += '"';
  }
  return hex;
}

void AppendHeaderSum(std::string& out, std::uint64_t header_sum) {
  out += ",\"ckpt.header_xxh3\":\"" + ChecksumHex(header_sum) + "\"";
  out += '}';
}

void AppendEntry(std::string& out, const ShardItem& item) {
  out += ',';
  AppendString(out, item.TensorKey());
  out += ":{\"dtype\":\"";
  out += DTypeName(item.dtype);
  out += "\",\"shape\":[";
  for (std::size_t i = 0; i < item.shape.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(item.shape[i]);
  }
  out += "],\"data_offsets\":[" + std::to_string(item.offset) + "," +
         std::to_string(item.offset + item.length) + "]}";
}

// `header_sum` is fixed width: planning renders a placeholder, saving the real one.
std::string RenderJson(const ShardMeta& meta, const std::vector<ShardItem>& items, std::uint64_t header_sum) {
  std::string out;
  out.reserve(256 + items.size() * 160);
  out += RenderIdentity(meta, AnyNeedsFormat3(items));
  for (const auto& item : items) AppendItemMeta(out, item);
  AppendHeaderSum(out, header_sum);
  for (const auto& item : items) AppendEntry(out, item);
  out += '}';
  return out;
}

// The same 16 lowercase hex digits as ChecksumHex, written in place.
void PutHex(char* dst, std::uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  for (int i = 15; i >= 0; --i) {
    dst[i] = kDigits[value & 0xf];
    value >>= 4;
  }
}

constexpr std::size_t kHexDigits = 16;

std::size_t HeaderSumBytes() {
  static const std::size_t bytes = [] {
    std::string text;
    AppendHeaderSum(text, 0);
    return text.size();
  }();
  return bytes;
}

Status CheckAndPack(std::vector<ShardItem>& items, std::size_t first, std::uint64_t offset,
                    const std::unordered_set<std::string>* taken, std::uint64_t* data_bytes) {
  std::unordered_set<std::string_view> names;
  names.reserve(items.size() - first);
  for (std::size_t i = first; i < items.size(); ++i) {
    ShardItem& item = items[i];
    if (!names.insert(item.name).second || (taken != nullptr && taken->count(item.name) != 0)) {
      return AlreadyExists("duplicate item name " + QuoteName(item.name));
    }
    if (Status s = CheckItemShape(item); !s.ok()) return s;
    if (Status s = CheckFormat3Fields(item); !s.ok()) return s;
    if (item.length > kMaxShardDataBytes - offset) {
      return InvalidArgument("items of the shard total more than " + std::to_string(kMaxShardDataBytes) +
                             " bytes (at item " + QuoteName(item.name) + ")");
    }
    item.offset = offset;
    offset += item.length;
  }
  *data_bytes = offset;
  return Status::Ok();
}

Result<std::uint64_t> HeaderBytesFor(std::uint64_t json_bytes) {
  if (json_bytes > kMaxHeaderBytes) {
    return ResourceExhausted("shard header would be " + std::to_string(json_bytes) +
                             " bytes, over the safetensors limit of 100 MB");
  }
  return AlignUp(8 + json_bytes, kDataAlignment);
}

}  // namespace

ShardLayout ShardLayout::Unplanned(ShardMeta meta, std::vector<ShardItem> items) {
  ShardLayout layout;
  layout.meta_ = std::move(meta);
  layout.items_ = std::move(items);
  return layout;
}

Result<ShardLayout> ShardLayout::Plan(ShardMeta meta, std::vector<ShardItem> items) {
  ShardLayout layout = Unplanned(std::move(meta), std::move(items));
  if (Status s = layout.PlanInPlace(); !s.ok()) return s;
  return layout;
}

Status ShardLayout::PlanInPlace() {
  if (tensors_) return PlanAfterTensors();
  if (Status s = CheckAndPack(items_, 0, 0, nullptr, &data_bytes_); !s.ok()) return s;
  auto header_bytes = HeaderBytesFor(RenderJson(meta_, items_, 0).size());
  if (!header_bytes.ok()) return header_bytes.status();
  header_bytes_ = header_bytes.value();
  planned_ = true;
  return Status::Ok();
}

std::string ShardLayout::RenderHeader() const {
  if (tensors_) return RenderHeaderAfterTensors();
  std::string json = RenderJson(meta_, items_, HeaderChecksum(meta_, items_));
  std::uint64_t n = header_bytes_ - 8;
  // Checksums are fixed width, so the JSON never outgrows the size planned for it.
  std::string out(header_bytes_, ' ');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, json.data(), std::min<std::size_t>(json.size(), n));
  return out;
}

Result<std::shared_ptr<const TensorPlan>> TensorPlan::Make(std::vector<ShardItem> items) {
  if (items.size() > UINT32_MAX) return InvalidArgument("too many items for one shard");
  auto plan = std::make_shared<TensorPlan>();
  if (Status s = CheckAndPack(items, 0, 0, nullptr, &plan->data_bytes_); !s.ok()) return s;
  plan->items_ = std::move(items);
  const auto& all = plan->items_;
  plan->names_.reserve(all.size());
  plan->meta_hex_.reserve(all.size());
  plan->meta_blocks_.reserve(all.size());
  plan->format3_ = AnyNeedsFormat3(all);
  for (const auto& item : all) {
    plan->names_.insert(item.name);
    std::size_t blocks = kNoBlocks;
    plan->meta_hex_.push_back(AppendItemMeta(plan->meta_, item, &blocks));
    plan->meta_blocks_.push_back(blocks);
    AppendEntry(plan->entries_, item);
  }
  std::vector<std::pair<std::string, std::uint32_t>> keyed;
  keyed.reserve(all.size());
  for (std::size_t i = 0; i < all.size(); ++i)
    keyed.emplace_back(all[i].TensorKey(), static_cast<std::uint32_t>(i));
  std::sort(keyed.begin(), keyed.end());
  plan->by_key_.reserve(all.size());
  plan->digest_line_.reserve(all.size() + 1);
  plan->digest_hex_.reserve(all.size());
  plan->digest_blocks_.reserve(all.size());
  for (const auto& [key, index] : keyed) {
    plan->by_key_.push_back(index);
    plan->digest_line_.push_back(plan->digest_.size());
    std::size_t blocks = kNoBlocks;
    plan->digest_hex_.push_back(AppendDigestLine(plan->digest_, key, all[index], &blocks));
    plan->digest_blocks_.push_back(blocks);
  }
  plan->digest_line_.push_back(plan->digest_.size());
  return std::shared_ptr<const TensorPlan>(std::move(plan));
}

ShardLayout ShardLayout::Unplanned(ShardMeta meta, std::shared_ptr<const TensorPlan> tensors,
                                   std::vector<ShardItem> blobs) {
  std::vector<ShardItem> items;
  items.reserve(tensors->items().size() + blobs.size());
  items.insert(items.end(), tensors->items().begin(), tensors->items().end());
  for (auto& blob : blobs) items.push_back(std::move(blob));
  ShardLayout layout = Unplanned(std::move(meta), std::move(items));
  layout.tensors_ = std::move(tensors);
  return layout;
}

namespace {

// The parts of a header that a TensorPlan does not hold: the identity and the blobs'.
struct BlobParts {
  std::string identity;
  std::string meta;     // the blobs' AppendItemMeta, in item order
  std::string entries;  // the blobs' AppendEntry, in item order
};

BlobParts RenderBlobParts(const ShardMeta& meta, const std::vector<ShardItem>& items, std::size_t first,
                          bool format3) {
  BlobParts parts;
  parts.identity = RenderIdentity(meta, format3);
  for (std::size_t i = first; i < items.size(); ++i) {
    AppendItemMeta(parts.meta, items[i]);
    AppendEntry(parts.entries, items[i]);
  }
  return parts;
}

std::uint64_t JsonBytes(const BlobParts& parts, std::size_t plan_meta, std::size_t plan_entries) {
  return parts.identity.size() + plan_meta + parts.meta.size() + HeaderSumBytes() + plan_entries +
         parts.entries.size() + 1;
}

}  // namespace

Status ShardLayout::PlanAfterTensors() {
  const std::size_t first = tensors_->items_.size();
  if (items_.size() < first) return Internal("shard layout lost its planned tensors");
  if (Status s = CheckAndPack(items_, first, tensors_->data_bytes_, &tensors_->names_, &data_bytes_);
      !s.ok()) {
    return s;
  }
  const BlobParts parts =
      RenderBlobParts(meta_, items_, first, tensors_->format3_ || AnyNeedsFormat3(items_, first));
  auto header_bytes = HeaderBytesFor(JsonBytes(parts, tensors_->meta_.size(), tensors_->entries_.size()));
  if (!header_bytes.ok()) return header_bytes.status();
  header_bytes_ = header_bytes.value();
  planned_ = true;
  return Status::Ok();
}

std::string ShardLayout::RenderHeaderAfterTensors() const {
  const TensorPlan& plan = *tensors_;
  const std::size_t first = plan.items_.size();

  // HeaderDigestText: the plan's lines in key order with the blobs' merged in and every
  // checksum written over its placeholder.
  std::vector<std::pair<std::string, const ShardItem*>> blobs;
  blobs.reserve(items_.size() - first);
  for (std::size_t i = first; i < items_.size(); ++i) blobs.emplace_back(items_[i].TensorKey(), &items_[i]);
  std::sort(blobs.begin(), blobs.end());
  const bool format3 = plan.format3_ || AnyNeedsFormat3(items_, first);
  std::string digest = DigestIdentity(meta_, format3);
  digest.reserve(digest.size() + plan.digest_.size() + blobs.size() * 96);
  std::size_t line = 0;  // next of the plan's lines, in key order
  auto copy_lines_until = [&](std::size_t end) {
    const std::size_t at = digest.size();
    const std::size_t from = plan.digest_line_[line];
    digest.append(plan.digest_, from, plan.digest_line_[end] - from);
    for (; line < end; ++line) {
      const ShardItem& item = items_[plan.by_key_[line]];
      PutHex(digest.data() + at + (plan.digest_hex_[line] - from), item.checksum);
      if (plan.digest_blocks_[line] != kNoBlocks) {
        char* blocks = digest.data() + at + (plan.digest_blocks_[line] - from);
        for (std::size_t b = 0; b < item.blocks.sums.size(); ++b)
          PutHex(blocks + kHexDigits * b, item.blocks.sums[b]);
      }
    }
  };
  for (const auto& [key, blob] : blobs) {
    const std::size_t end =
        std::upper_bound(
            plan.by_key_.begin() + static_cast<std::ptrdiff_t>(line), plan.by_key_.end(), key,
            [&](const std::string& k, std::uint32_t index) { return k < plan.items_[index].TensorKey(); }) -
        plan.by_key_.begin();
    copy_lines_until(end);
    AppendDigestLine(digest, key, *blob);
  }
  copy_lines_until(plan.by_key_.size());
  const std::uint64_t header_sum = Checksum::Of(digest.data(), digest.size());

  const BlobParts parts = RenderBlobParts(meta_, items_, first, format3);
  std::string out(header_bytes_, ' ');
  const std::uint64_t n = header_bytes_ - 8;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  char* p = out.data() + 8;
  auto put = [&](std::string_view text) {
    std::memcpy(p, text.data(), text.size());
    p += text.size();
  };
  put(parts.identity);
  char* const meta = p;
  put(plan.meta_);
  for (std::size_t i = 0; i < first; ++i) {
    PutHex(meta + plan.meta_hex_[i], items_[i].checksum);
    if (plan.meta_blocks_[i] != kNoBlocks) {
      char* blocks = meta + plan.meta_blocks_[i];
      for (std::size_t b = 0; b < items_[i].blocks.sums.size(); ++b)
        PutHex(blocks + kHexDigits * b, items_[i].blocks.sums[b]);
    }
  }
  put(parts.meta);
  std::string sum;
  AppendHeaderSum(sum, header_sum);
  put(sum);
  put(plan.entries_);
  put(parts.entries);
  put("}");
  return out;
}

Result<std::string> RenderDifferentialHeader(const ShardMeta& meta, std::uint64_t base,
                                             std::vector<ShardItem>& items, std::uint64_t* data_bytes) {
  if (base >= meta.version) {
    return InvalidArgument("the base of version " + std::to_string(meta.version) + " must be an earlier version, not " +
                           std::to_string(base));
  }
  std::unordered_set<std::string_view> names;
  names.reserve(items.size());
  std::uint64_t offset = 0;
  for (ShardItem& item : items) {
    if (!names.insert(item.name).second) return AlreadyExists("duplicate item name " + QuoteName(item.name));
    if (Status s = CheckItemShape(item); !s.ok()) return s;
    if (Status s = CheckFormat3Fields(item); !s.ok()) return s;
    if (item.in_base) {
      item.offset = 0;
      continue;
    }
    if (item.length > kMaxShardDataBytes - offset) {
      return InvalidArgument("items of the shard total more than " + std::to_string(kMaxShardDataBytes) +
                             " bytes (at item " + QuoteName(item.name) + ")");
    }
    item.offset = offset;
    offset += item.length;
  }
  std::string json = "{\"__metadata__\":{\"ckpt.format_version\":";
  AppendString(json, kFormatVersionDifferential);
  json += RenderIdentityFields(meta);
  json += ",\"" + std::string(kBaseKey) + "\":\"" + std::to_string(base) + "\"";
  for (const ShardItem& item : items) {
    AppendItemMeta(json, item);
    if (!item.in_base) continue;
    json += ',';
    AppendString(json, std::string(kRefKeyPrefix) + item.name);
    std::string ref = std::string(DTypeName(item.dtype)) + " [";
    for (std::size_t i = 0; i < item.shape.size(); ++i) ref += (i ? "," : "") + std::to_string(item.shape[i]);
    json += ':';
    AppendString(json, ref + "]");
  }
  AppendHeaderSum(json, HeaderChecksum(meta, items, base));
  for (const ShardItem& item : items) {
    if (!item.in_base) AppendEntry(json, item);
  }
  json += '}';
  auto header_bytes = HeaderBytesFor(json.size());
  if (!header_bytes.ok()) return header_bytes.status();
  std::string out(header_bytes.value(), ' ');
  const std::uint64_t n = header_bytes.value() - 8;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, json.data(), json.size());
  *data_bytes = offset;
  return out;
}

}  // namespace ckpt
