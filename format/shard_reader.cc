// The reader of the shard file (format/shard_format.h): the header parsed and validated
// (ParseShardHeader, ReadShardHeader), and every item's bytes checked (VerifyShard).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "common/names.h"
#include "common/safe_file.h"
#include "common/unique_fd.h"
#include "format/checksum.h"
#include "format/limits.h"
#include "format/shard_files.h"
#include "format/shard_format.h"
#include "format/shard_format_internal.h"

namespace ckpt {
namespace {

using shard_internal::CheckFormat3Fields;
using shard_internal::KindName;

// Parsing uses the map-backed json: key order does not matter, items are sorted by offset.
using Json = nlohmann::json;

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

// An item of a differential shard whose bytes are in its base: `ref` is its ckpt.ref.<name>,
// "<DTYPE> [<d0>,<d1>,...]"; its kind and checksum come from ckpt.item.<name>.
Result<ShardItem> ParseRefItem(const Json& md, const std::string& name, const Json& ref) {
  auto bad = [&](const std::string& why) {
    return DataLoss("shard metadata " + std::string(kRefKeyPrefix) + "<item> of item " + QuoteName(name) +
                    " is malformed: " + why);
  };
  if (!ref.is_string()) return bad("not a string");
  const std::string& text = ref.get_ref<const std::string&>();
  ShardItem item;
  item.name = name;
  item.in_base = true;
  const std::size_t space = text.find(' ');
  if (space == std::string::npos || text.size() < space + 3 || text[space + 1] != '[' || text.back() != ']') {
    return bad("'" + text + "' is not \"<DTYPE> [<dims>]\"");
  }
  auto dtype = ParseDType(text.substr(0, space));
  if (!dtype) return bad("unknown dtype in '" + text + "'");
  item.dtype = *dtype;
  const std::string dims = text.substr(space + 2, text.size() - space - 3);
  std::uint64_t elems = 1;
  for (std::size_t at = 0; !dims.empty();) {
    const std::size_t comma = std::min(dims.find(',', at), dims.size());
    const std::string d = dims.substr(at, comma - at);
    if (d.empty() || d.size() > 15 || d.find_first_not_of("0123456789") != std::string::npos) {
      return bad("bad dimension in '" + text + "'");
    }
    const std::uint64_t v = std::stoull(d);
    item.shape.push_back(static_cast<std::int64_t>(v));
    if (v != 0 && elems > kMaxShardDataBytes / v) return bad("shape in '" + text + "' is too large");
    elems *= v;
    if (comma == dims.size()) break;
    at = comma + 1;
  }
  if (elems > kMaxShardDataBytes / DTypeSize(item.dtype)) return bad("shape in '" + text + "' is too large");
  item.length = elems * DTypeSize(item.dtype);
  auto meta_it = md.find("ckpt.item." + name);
  if (meta_it == md.end() || !meta_it->is_string()) {
    return DataLoss("shard metadata has no checksum for " + QuoteName(name));
  }
  const std::string& m = meta_it->get_ref<const std::string&>();
  bool parsed = false;
  for (ItemKind kind : {ItemKind::kTensor, ItemKind::kBlob}) {
    const std::string want = "kind=" + KindName(kind) + " xxh3=";
    if (m.rfind(want, 0) == 0 && ParseChecksumHex(m.substr(want.size()), &item.checksum)) {
      item.kind = kind;
      parsed = true;
    }
  }
  if (!parsed) return DataLoss("shard metadata for " + QuoteName(name) + " is malformed: '" + m + "'");
  if (item.kind == ItemKind::kBlob && (item.dtype != DType::kU8 || item.shape.size() != 1)) {
    return bad("blob's bytes are not \"U8 [<length>]\"");
  }
  return item;
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
       fv->get_ref<const std::string&>() != kFormatVersionDifferential &&
       fv->get_ref<const std::string&>() != kFormatVersionWithoutHeaderChecksum)) {
    return DataLoss("shard has an unknown ckpt.format_version (this reader knows " +
                    std::string(kFormatVersionWithoutHeaderChecksum) + " to " +
                    std::string(kFormatVersionDifferential) + ")");
  }
  info.format_version = fv->get<std::string>();
  const bool differential = info.format_version == kFormatVersionDifferential;
  // Format 4 may have every key of format 3.
  const bool format3 = info.format_version == kFormatVersionWithLayouts || differential;
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
  const auto& md_keys = md.get_ref<const Json::object_t&>();
  auto has_prefix = [&](std::string_view prefix) {
    auto it = md_keys.lower_bound(std::string(prefix));
    return it != md_keys.end() && it->first.starts_with(prefix);
  };
  if (differential) {
    auto base = ParseUint(md, std::string(kBaseKey));
    if (!base.ok()) return base.status();
    if (base.value() >= info.meta.version) {
      return DataLoss("differential shard of version " + std::to_string(info.meta.version) + " names base version " +
                      std::to_string(base.value()) + ", which is not an earlier version");
    }
    info.base = base.value();
  } else if (md.contains(std::string(kBaseKey)) || has_prefix(kRefKeyPrefix)) {
    return DataLoss("shard of format version " + info.format_version + " has a " + std::string(kBaseKey) +
                    " or ckpt.ref key, which only format " + std::string(kFormatVersionDifferential) + " has");
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
    if (Status s = CheckItemShape(item); !s.ok()) return DataLoss(s.message());
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
    if (differential && md.contains(std::string(kRefKeyPrefix) + item.name)) {
      return DataLoss("item " + QuoteName(item.name) + " is both stored in the shard and left to its base");
    }
    info.items.push_back(std::move(item));
  }
  if (differential) {
    // The items whose bytes are in the base: described by ckpt.ref.<name> and ckpt.item.<name>.
    std::uint64_t in_base_bytes = 0;
    for (auto it = md_keys.lower_bound(std::string(kRefKeyPrefix));
         it != md_keys.end() && it->first.starts_with(kRefKeyPrefix); ++it) {
      auto ref = ParseRefItem(md, it->first.substr(kRefKeyPrefix.size()), it->second);
      if (!ref.ok()) return ref.status();
      ShardItem item = std::move(ref).value();
      if (item.length > kMaxShardDataBytes - in_base_bytes) {
        return DataLoss("the items a differential shard leaves to its base total more than " +
                        std::to_string(kMaxShardDataBytes) + " bytes");
      }
      in_base_bytes += item.length;
      if (Status s = ParseFormat3Fields(md, info.meta.world_size, item, &format3_keys); !s.ok()) return s;
      info.items.push_back(std::move(item));
    }
  }
  // Every key of format 3 belongs to an item, and only formats 3 and 4 have them.
  std::size_t stored_format3_keys = 0;
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
  // Items left to the base come last, in name order.
  std::sort(info.items.begin(), info.items.end(), [](const ShardItem& a, const ShardItem& b) {
    if (a.in_base != b.in_base) return b.in_base;
    if (a.in_base) return a.name < b.name;
    return a.offset != b.offset ? a.offset < b.offset : a.length < b.length;
  });
  std::uint64_t expect = 0;
  for (const auto& item : info.items) {
    if (item.in_base) break;
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
    const std::uint64_t computed = HeaderChecksum(info.meta, info.items, info.base);
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
  // Header and data from descriptors held open: what is verified is the files that were
  // checked, whatever is renamed over the paths meanwhile. A differential shard's items are
  // read from its base where they are there.
  auto files = ShardFiles::Open(path);
  if (!files.ok()) return files.status();
  const ShardInfo& info = files->info();
  // No more than the largest item: verifying many small shards (ckptctl verify, the fuzzer)
  // should not allocate and clear 8 MiB each.
  std::uint64_t largest = 1;
  for (const auto& item : info.items) largest = std::max(largest, item.length);
  std::vector<char> buf(static_cast<std::size_t>(std::min<std::uint64_t>(largest, 8 << 20)));
  for (std::size_t i = 0; i < info.items.size(); ++i) {
    const ShardItem& item = info.items[i];
    const std::string& where = *files->Locate(i).path;
    Checksum sum;
    std::unique_ptr<Checksum> block;  // the block being hashed, for items with block checksums
    const std::uint64_t bs = item.blocks.block_bytes;
    std::uint64_t done = 0;
    while (done < item.length) {
      const std::size_t r = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), item.length - done));
      if (Status s = files->Read(i, done, buf.data(), r); !s.ok()) return s;
      sum.Update(buf.data(), r);
      for (std::uint64_t at = 0; bs != 0 && at < r;) {
        const std::uint64_t pos = done + at;
        const std::uint64_t index = pos / bs;
        const std::uint64_t block_end = std::min((index + 1) * bs, item.length);
        const std::uint64_t take = std::min<std::uint64_t>(block_end - pos, r - at);
        if (pos % bs == 0) block = std::make_unique<Checksum>();
        block->Update(buf.data() + at, take);
        if (pos + take == block_end && block->Digest() != item.blocks.sums[index]) {
          return DataLoss(where + ": checksum mismatch in block " + std::to_string(index) + " of item " +
                          QuoteName(item.name) + " (stored " + ChecksumHex(item.blocks.sums[index]) +
                          ", computed " + ChecksumHex(block->Digest()) + ")");
        }
        at += take;
      }
      done += r;
    }
    if (sum.Digest() != item.checksum) {
      return DataLoss(where + ": checksum mismatch in item " + QuoteName(item.name) + " (stored " +
                      ChecksumHex(item.checksum) + ", computed " + ChecksumHex(sum.Digest()) + ")" +
                      (item.in_base ? " (read from the base of " + path + ")" : ""));
    }
  }
  return Status::Ok();
}

}  // namespace ckpt
