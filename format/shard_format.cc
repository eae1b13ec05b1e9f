#include "format/shard_format.h"
#include "common/align.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>
#include <vector>

#include "common/names.h"
#include "common/safe_file.h"
#include "common/unique_fd.h"
#include "format/checksum.h"
#include "format/limits.h"

namespace ckpt {
namespace {

// Parsing uses the map-backed json: key order does not matter, items are sorted by offset.
using Json = nlohmann::json;

std::string KindName(ItemKind k) { return k == ItemKind::kBlob ? "blob" : "tensor"; }

std::string ItemMeta(const ShardItem& item) {
  return "kind=" + KindName(item.kind) + " xxh3=" + ChecksumHex(item.checksum);
}

// Renders the header by hand: nlohmann's ordered_json inserts in linear time per key,
// which made headers of thousands of items cost tens of milliseconds.
void AppendString(std::string& out, std::string_view text) { out += nlohmann::json(text).dump(); }

bool AnyNeedsFormat3(const std::vector<ShardItem>& items, std::size_t first = 0) {
  for (std::size_t i = first; i < items.size(); ++i) {
    if (items[i].NeedsFormat3()) return true;
  }
  return false;
}

// The JSON from its opening brace to the last identity field of __metadata__.
std::string RenderIdentity(const ShardMeta& meta, bool format3) {
  std::string out = "{\"__metadata__\":{\"ckpt.format_version\":";
  AppendString(out, format3 ? kFormatVersionWithLayouts : kFormatVersion);
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

constexpr std::size_t kNoBlocks = std::string::npos;

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

Status CheckItemShapeImpl(const ShardItem& item) {
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

Result<std::uint64_t> ParseUint(const Json& md, const std::string& key) {
  auto it = md.find(key);
  if (it == md.end() || !it->is_string()) {
    return DataLoss("shard metadata lacks " + key);
  }
  const std::string& s = it->get_ref<const std::string&>();
  if (s.empty() || s.size() > 19 || s.find_first_not_of("0123456789") != std::string::npos) {
    return DataLoss("shard metadata " + key + " is not a number: '" + s + "'");
  }
  return static_cast<std::uint64_t>(std::stoull(s));
}

void AppendCounted(std::string& out, std::string_view text) {
  out += std::to_string(text.size());
  out += ':';
  out += text;
}

}  // namespace

namespace {

std::string DigestIdentity(const ShardMeta& meta, bool format3) {
  std::string out = format3 ? "ckptd-shard-header 3 job " : "ckptd-shard-header 2 job ";
  AppendCounted(out, meta.job);
  out += " version " + std::to_string(meta.version) + " rank " + std::to_string(meta.rank) + " world_size " +
         std::to_string(meta.world_size) + " session ";
  AppendCounted(out, meta.session);
  out += '\n';
  return out;
}

// One item's line. Returns where its checksum's hex digits are; *blocks (if given) gets
// where its first block checksum's are (kNoBlocks: none).
std::size_t AppendDigestLine(std::string& out, const std::string& key, const ShardItem& item,
                             std::size_t* blocks = nullptr) {
  out += "item ";
  AppendCounted(out, key);
  out += ' ' + KindName(item.kind) + ' ' + std::string(DTypeName(item.dtype)) + " [";
  for (std::size_t i = 0; i < item.shape.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(item.shape[i]);
  }
  out += "] " + std::to_string(item.offset) + ' ' + std::to_string(item.offset + item.length) + ' ';
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

// What format 3 adds to an item, checked the same way for a plan and a parsed header: a
// tensor's layout fits its shape, its blocks are of a size readers take (planning sizes their
// sums), only blobs have a for_rank. InvalidArgument naming the item.
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

Status CheckAndPack(std::vector<ShardItem>& items, std::size_t first, std::uint64_t offset,
                    const std::unordered_set<std::string>* taken, std::uint64_t* data_bytes) {
  std::unordered_set<std::string_view> names;
  names.reserve(items.size() - first);
  for (std::size_t i = first; i < items.size(); ++i) {
    ShardItem& item = items[i];
    if (!names.insert(item.name).second || (taken != nullptr && taken->count(item.name) != 0)) {
      return AlreadyExists("duplicate item name " + QuoteName(item.name));
    }
    if (Status s = CheckItemShapeImpl(item); !s.ok()) return s;
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

std::string HeaderDigestText(const ShardMeta& meta, const std::vector<ShardItem>& items) {
  std::string out = DigestIdentity(meta, AnyNeedsFormat3(items));
  std::vector<std::pair<std::string, const ShardItem*>> keyed;
  keyed.reserve(items.size());
  for (const auto& item : items) keyed.emplace_back(item.TensorKey(), &item);
  std::sort(keyed.begin(), keyed.end());
  for (const auto& [key, item] : keyed) AppendDigestLine(out, key, *item);
  return out;
}

std::uint64_t HeaderChecksum(const ShardMeta& meta, const std::vector<ShardItem>& items) {
  const std::string text = HeaderDigestText(meta, items);
  return Checksum::Of(text.data(), text.size());
}

std::string ShardItem::TensorKey() const {
  return kind == ItemKind::kBlob ? std::string(kBlobPrefix) + name : name;
}

Status CheckItemShape(const ShardItem& item) { return CheckItemShapeImpl(item); }

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

namespace {

const std::string* FindString(const Json& md, const std::string& key, bool* malformed) {
  auto it = md.find(key);
  if (it == md.end()) return nullptr;
  if (!it->is_string()) {
    *malformed = true;
    return nullptr;
  }
  return &it->get_ref<const std::string&>();
}

// Reads the keys of format 3 of `item` from `md` and checks them; counts those it found.
Status ParseFormat3Fields(const Json& md, std::uint32_t world_size, ShardItem& item, std::size_t* found) {
  bool malformed = false;
  auto fail = [&](std::string_view prefix, const Status& why) {
    return DataLoss("shard metadata " + std::string(prefix) + "<item> of item " + QuoteName(item.name) +
                    " is malformed: " + why.message());
  };
  if (const std::string* text = FindString(md, std::string(kLayoutKeyPrefix) + item.name, &malformed)) {
    ++*found;
    auto layout = DecodeLayout(*text);
    if (!layout.ok()) return fail(kLayoutKeyPrefix, layout.status());
    GlobalLayout resolved = std::move(layout).value();
    if (item.kind == ItemKind::kTensor) {
      if (Status s = ResolveLayout(item.name, item.shape, &resolved); !s.ok())
        return fail(kLayoutKeyPrefix, s);
    }
    item.layout = std::move(resolved);
  }
  if (const std::string* text = FindString(md, std::string(kBlocksKeyPrefix) + item.name, &malformed)) {
    ++*found;
    auto blocks = DecodeBlockSums(*text, item.length);
    if (!blocks.ok()) return fail(kBlocksKeyPrefix, blocks.status());
    item.blocks = std::move(blocks).value();
  }
  if (const std::string* text = FindString(md, std::string(kForRankKeyPrefix) + item.name, &malformed)) {
    ++*found;
    auto rank = DecodeForRank(*text, world_size);
    if (!rank.ok()) return fail(kForRankKeyPrefix, rank.status());
    item.for_rank = rank.value();
  }
  if (malformed)
    return DataLoss("shard metadata of format 3 for " + QuoteName(item.name) + " is not a string");
  if (Status s = CheckFormat3Fields(item); !s.ok()) return DataLoss(s.message());
  return Status::Ok();
}

}  // namespace

Result<ShardInfo> ParseShardHeader(std::string_view text, std::uint64_t file_bytes) {
  Json header = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return DataLoss("shard header is not a JSON object");
  }
  ShardInfo info;
  info.data_start = 8 + text.size();
  info.file_bytes = file_bytes;
  auto md_it = header.find("__metadata__");
  if (md_it == header.end() || !md_it->is_object()) {
    return DataLoss("shard header has no __metadata__ (not a ckptd shard)");
  }
  const Json& md = *md_it;
  auto fv = md.find("ckpt.format_version");
  if (fv == md.end() || !fv->is_string() ||
      (fv->get_ref<const std::string&>() != kFormatVersion &&
       fv->get_ref<const std::string&>() != kFormatVersionWithLayouts &&
       fv->get_ref<const std::string&>() != kFormatVersionWithoutHeaderChecksum)) {
    return DataLoss("shard has an unknown ckpt.format_version (this reader knows " +
                    std::string(kFormatVersionWithoutHeaderChecksum) + ", " + std::string(kFormatVersion) +
                    " and " + std::string(kFormatVersionWithLayouts) + ")");
  }
  info.format_version = fv->get<std::string>();
  const bool format3 = info.format_version == kFormatVersionWithLayouts;
  const bool has_header_sum = info.format_version != kFormatVersionWithoutHeaderChecksum;
  auto header_sum = md.find("ckpt.header_xxh3");
  std::uint64_t stored_header_sum = 0;
  if (has_header_sum) {
    if (header_sum == md.end() || !header_sum->is_string() ||
        !ParseChecksumHex(header_sum->get<std::string>(), &stored_header_sum)) {
      return DataLoss("shard metadata lacks a well-formed ckpt.header_xxh3 (format version " +
                      info.format_version + " has one)");
    }
  } else if (header_sum != md.end()) {
    return DataLoss("shard of format version " + info.format_version +
                    " has a ckpt.header_xxh3, which that version never wrote");
  }
  auto job = md.find("ckpt.job");
  if (job == md.end() || !job->is_string()) return DataLoss("shard metadata lacks ckpt.job");
  info.meta.job = job->get<std::string>();
  auto version = ParseUint(md, "ckpt.version");
  auto rank = ParseUint(md, "ckpt.rank");
  auto world = ParseUint(md, "ckpt.world_size");
  for (const Status* s : {&version.status(), &rank.status(), &world.status()}) {
    if (!s->ok()) return *s;
  }
  if (world.value() > kMaxWorldSize) {
    return DataLoss("shard metadata names world size " + std::to_string(world.value()) +
                    ", over the largest a reader takes (" + std::to_string(kMaxWorldSize) + ")");
  }
  if (rank.value() >= world.value()) {
    return DataLoss("shard metadata names rank " + std::to_string(rank.value()) + " of world size " +
                    std::to_string(world.value()) + ", which is not a rank of a world size");
  }
  info.meta.version = version.value();
  info.meta.rank = static_cast<std::uint32_t>(rank.value());
  info.meta.world_size = static_cast<std::uint32_t>(world.value());
  if (auto session = md.find("ckpt.session"); session != md.end() && session->is_string()) {
    info.meta.session = session->get<std::string>();
  }

  std::size_t format3_keys = 0;  // found for the items
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const Json& t = it.value();
    ShardItem item;
    std::string key = it.key();
    if (key.rfind(kBlobPrefix, 0) == 0) {
      item.kind = ItemKind::kBlob;
      item.name = key.substr(kBlobPrefix.size());
    } else {
      item.name = key;
    }
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets") ||
        !t["dtype"].is_string() || !t["shape"].is_array() || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return DataLoss("shard entry " + QuoteName(key) + " is malformed");
    }
    auto dtype = ParseDType(t["dtype"].get<std::string>());
    if (!dtype) return DataLoss("shard entry " + QuoteName(key) + " has an unknown dtype");
    item.dtype = *dtype;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) {
        return DataLoss("shard entry " + QuoteName(key) + " has a bad shape");
      }
      item.shape.push_back(d.get<std::int64_t>());
    }
    const auto& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return DataLoss("shard entry " + QuoteName(key) + " has bad data_offsets");
    }
    std::uint64_t begin = off[0].get<std::uint64_t>();
    std::uint64_t end = off[1].get<std::uint64_t>();
    if (end < begin) return DataLoss("shard entry " + QuoteName(key) + " ends before it begins");
    item.offset = begin;
    item.length = end - begin;
    if (Status s = CheckItemShapeImpl(item); !s.ok()) return DataLoss(s.message());
    auto meta_it = md.find("ckpt.item." + item.name);
    if (meta_it == md.end() || !meta_it->is_string()) {
      return DataLoss("shard metadata has no checksum for " + QuoteName(item.name));
    }
    const std::string m = meta_it->get<std::string>();
    const std::string want_kind = "kind=" + KindName(item.kind) + " xxh3=";
    if (m.rfind(want_kind, 0) != 0 || !ParseChecksumHex(m.substr(want_kind.size()), &item.checksum)) {
      return DataLoss("shard metadata for " + QuoteName(item.name) + " is malformed: '" + m + "'");
    }
    if (format3) {
      if (Status s = ParseFormat3Fields(md, info.meta.world_size, item, &format3_keys); !s.ok()) return s;
    }
    info.items.push_back(std::move(item));
  }
  // Every key of format 3 belongs to an item, and only format 3 has them.
  std::size_t stored_format3_keys = 0;
  const auto& md_keys = md.get_ref<const Json::object_t&>();
  for (const std::string_view prefix : {kLayoutKeyPrefix, kBlocksKeyPrefix, kForRankKeyPrefix}) {
    for (auto it = md_keys.lower_bound(std::string(prefix));
         it != md_keys.end() && it->first.starts_with(prefix); ++it) {
      ++stored_format3_keys;
    }
  }
  if (stored_format3_keys != format3_keys) {
    return DataLoss(format3
                        ? "shard metadata has a ckpt.layout, ckpt.blocks or ckpt.for_rank key of no item"
                        : "shard of format version " + info.format_version +
                              " has ckpt.layout, ckpt.blocks or ckpt.for_rank keys, which only format 3 has");
  }
  // An empty item shares its offset with the item after it: it sorts first, so the tiling
  // check below does not see an overlap.
  std::sort(info.items.begin(), info.items.end(), [](const ShardItem& a, const ShardItem& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.length < b.length;
  });
  std::uint64_t expect = 0;
  for (const auto& item : info.items) {
    if (item.offset != expect) {
      return DataLoss("shard data section has a hole or overlap at item " + QuoteName(item.name));
    }
    expect += item.length;
  }
  if (info.data_start + expect != file_bytes) {
    return DataLoss("shard file is " + std::to_string(file_bytes) + " bytes but its header " + "describes " +
                    std::to_string(info.data_start + expect) + " (truncated?)");
  }
  if (has_header_sum) {
    const std::uint64_t computed = HeaderChecksum(info.meta, info.items);
    if (computed != stored_header_sum) {
      return DataLoss("shard header checksum mismatch (stored " + ChecksumHex(stored_header_sum) +
                      ", computed " + ChecksumHex(computed) +
                      "): the header's identity or item descriptions (name, dtype, shape, offsets, "
                      "checksums) changed after it was written");
    }
  }
  return info;
}

Result<ShardInfo> ReadShardHeader(const std::string& path) {
  auto fd = OpenRegularForRead(path);
  if (!fd.ok()) return fd.status().With("cannot open shard");
  return ReadShardHeader(fd->get(), path);
}

Result<ShardInfo> ReadShardHeader(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("cannot stat shard " + path, errno);
  if (!S_ISREG(st.st_mode))
    return DataLoss(path + " is " + FileTypeName(st.st_mode) + ", not a regular file");
  std::uint64_t file_bytes = static_cast<std::uint64_t>(st.st_size);
  unsigned char prefix[8];
  if (file_bytes < 8 || ::pread(fd, prefix, 8, 0) != 8) {
    return DataLoss("shard " + path + " is too short to hold a header");
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes || 8 + n > file_bytes) {
    return DataLoss("shard " + path + " declares a header of " + std::to_string(n) +
                    " bytes, which does not fit the file");
  }
  std::string json(n, '\0');
  std::uint64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, json.data() + got, n - got, static_cast<off_t>(8 + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return IoError("cannot read shard header of " + path, r < 0 ? errno : EIO);
    got += static_cast<std::uint64_t>(r);
  }
  auto info = ParseShardHeader(json, file_bytes);
  if (!info.ok()) return info.status().With(path);
  return info;
}

Status VerifyShard(const std::string& path) {
  auto fd = OpenRegularForRead(path);
  if (!fd.ok()) return fd.status().With("cannot open shard");
  // Header and data from one descriptor: what is verified is one file, whatever is renamed
  // over the path meanwhile.
  auto info = ReadShardHeader(fd->get(), path);
  if (!info.ok()) return info.status();
  // No more than the largest item: verifying many small shards (ckptctl verify, the fuzzer)
  // should not allocate and clear 8 MiB each.
  std::uint64_t largest = 1;
  for (const auto& item : info->items) largest = std::max(largest, item.length);
  std::vector<char> buf(static_cast<std::size_t>(std::min<std::uint64_t>(largest, 8 << 20)));
  for (const auto& item : info->items) {
    Checksum sum;
    std::unique_ptr<Checksum> block;  // the block being hashed, for items with block checksums
    const std::uint64_t bs = item.blocks.block_bytes;
    std::uint64_t done = 0;
    while (done < item.length) {
      std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), item.length - done));
      ssize_t r =
          ::pread(fd->get(), buf.data(), want, static_cast<off_t>(info->data_start + item.offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return IoError("cannot read " + path, r < 0 ? errno : EIO);
      sum.Update(buf.data(), static_cast<std::size_t>(r));
      for (std::uint64_t at = 0; bs != 0 && at < static_cast<std::uint64_t>(r);) {
        const std::uint64_t pos = done + at;
        const std::uint64_t index = pos / bs;
        const std::uint64_t block_end = std::min((index + 1) * bs, item.length);
        const std::uint64_t take = std::min(block_end - pos, static_cast<std::uint64_t>(r) - at);
        if (pos % bs == 0) block = std::make_unique<Checksum>();
        block->Update(buf.data() + at, take);
        if (pos + take == block_end && block->Digest() != item.blocks.sums[index]) {
          return DataLoss(path + ": checksum mismatch in block " + std::to_string(index) + " of item " +
                          QuoteName(item.name) + " (stored " + ChecksumHex(item.blocks.sums[index]) +
                          ", computed " + ChecksumHex(block->Digest()) + ")");
        }
        at += take;
      }
      done += static_cast<std::uint64_t>(r);
    }
    if (sum.Digest() != item.checksum) {
      return DataLoss(path + ": checksum mismatch in item " + QuoteName(item.name) + " (stored " +
                      ChecksumHex(item.checksum) + ", computed " + ChecksumHex(sum.Digest()) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace ckpt
