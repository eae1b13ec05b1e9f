// The shard file: one (version, rank) of a checkpoint, as a valid safetensors file.
//
//   [8 bytes little-endian N][N bytes JSON header, space-padded][data section]
//
// 8 + N is a multiple of 4 KiB, so the data section starts on a 4 KiB boundary and every
// chunk of it can be written with O_DIRECT. Items are packed in plan order with no gaps
// (safetensors requires the data section to be fully indexed). Blobs are U8 tensors named
// kBlobPrefix + name. `__metadata__` holds:
//   ckpt.format_version  "2", or "3" when an item has any of the keys of format 3 below
//   ckpt.job, ckpt.version, ckpt.rank, ckpt.world_size (and ckpt.session, optional)
//   ckpt.item.<name>     "kind=tensor xxh3=<16 hex>" (or kind=blob), one per item
//   ckpt.header_xxh3     <16 hex>: xxh3-64 of HeaderDigestText(), which spells out what
//                        the header says: the identity above and, for every item, its key,
//                        kind, dtype, shape, data offsets and checksum (and, in format 3,
//                        its layout, block checksums and for_rank)
// Format 3 adds, per item, as format/global_layout.h describes them:
//   ckpt.layout.<name>   a tensor's place in a global tensor (compact JSON)
//   ckpt.blocks.<name>   a tensor's per-block checksums ("<block bytes> <16 hex>...")
//   ckpt.for_rank.<name> a blob's rank, for a restore at another world size ("<rank>")
// Each follows its item's ckpt.item.<name> key. A shard without any of them is written as
// format 2, byte for byte as before format 3 existed.
// Format 4, a differential shard, holds only the items that changed since its base: an
// earlier version's full shard (format 1 to 3) of the same job, rank and world size, in the
// sibling version directory (ROOT/JOB/v<base>/, same file name). It adds
//   ckpt.base            "<base version>", lower than ckpt.version
//   ckpt.ref.<name>      "<DTYPE> [<d0>,<d1>,...]", one per item whose bytes are in the base
//                        (it has no tensor entry here; its ckpt.item.<name> checksum, and any
//                        keys of format 3, are as for a stored item)
// A standard safetensors reader sees the changed items under their own names, and nothing
// for the others; ckpt's readers (format/shard_files.h) take those from the base, checking
// that the base's item has the same kind, dtype, shape and checksum.
// The item checksums cover the bytes; the header checksum covers what the bytes mean, so
// an F32 item relabelled I32, a permuted shape or another ckpt.version is refused too.
// Format versions 1 (no ckpt.header_xxh3, otherwise the same as 2) and 2 are still read,
// version 1 with the item checksums only. Checksums are fixed-width, so the header can be rendered with
// placeholders when the layout is planned and rendered again, the same size, once the
// checksums are known.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "format/dtype.h"
#include "format/global_layout.h"

namespace ckpt {

inline constexpr std::uint64_t kDataAlignment = 4096;
inline constexpr std::string_view kBlobPrefix = "__blob__/";
// The version of a shard without layouts, block checksums or for_rank, and of one with them.
inline constexpr std::string_view kFormatVersion = "2";
inline constexpr std::string_view kFormatVersionWithLayouts = "3";
// The version of a differential shard (see above).
inline constexpr std::string_view kFormatVersionDifferential = "4";
inline constexpr std::string_view kBaseKey = "ckpt.base";
inline constexpr std::string_view kRefKeyPrefix = "ckpt.ref.";
// The version before the header checksum: read, never written.
inline constexpr std::string_view kFormatVersionWithoutHeaderChecksum = "1";
// Limit of the JSON header, as in the safetensors reference implementation.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// Largest data section of one shard (256 TiB): far beyond any rank's state, and small enough
// that sums of item lengths and file offsets can never wrap 64 bits, nor lose precision in
// readers that hold JSON numbers as doubles (exact to 2^53).
inline constexpr std::uint64_t kMaxShardDataBytes = std::uint64_t{1} << 48;

enum class ItemKind : std::uint8_t { kTensor = 1, kBlob = 2 };

struct ShardItem {
  std::string name;  // item name (without kBlobPrefix for blobs)
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;
  std::uint64_t length = 0;    // bytes
  std::uint64_t offset = 0;    // from the start of the data section
  std::uint64_t checksum = 0;  // xxh3-64 of the item's bytes
  // Format 3. Tensors: the place in a global tensor (resolved: format/global_layout.h), and
  // per-block checksums (blocks.block_bytes 0: none; planning sizes blocks.sums to one per
  // block, and they are set with the checksum). Blobs: the one rank a restore at another
  // world size gives it to.
  std::optional<GlobalLayout> layout;
  BlockSums blocks;
  std::optional<std::uint32_t> for_rank;
  // In a differential shard: the bytes are in the base version's shard, not in this file
  // (offset is then 0 and means nothing).
  bool in_base = false;

  // True if the item has anything only format 3 stores.
  bool NeedsFormat3() const { return layout.has_value() || blocks.block_bytes != 0 || for_rank.has_value(); }
  // The key of this item in the safetensors header.
  std::string TensorKey() const;
};

struct ShardMeta {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  // The registration of the rank that wrote the shard ("ckpt.session", optional): a commit
  // counts a shard only if it comes from the rank's current registration (see Catalog).
  std::string session;
};

// The items that lead every shard of one descriptor-table generation (the tensors), planned
// once: their offsets, and every part of the header they contribute except their checksums
// (the JSON of their metadata and entries, their lines of HeaderDigestText in key order).
// A layout made from it plans and renders a version's header in time linear in the blobs
// that follow, plus copying those parts and writing 16 hex digits per item, with the same
// bytes as a layout of the whole item list.
class TensorPlan {
 public:
  // Checks and packs `items` from offset 0, as ShardLayout::PlanInPlace does.
  static Result<std::shared_ptr<const TensorPlan>> Make(std::vector<ShardItem> items);

  const std::vector<ShardItem>& items() const { return items_; }
  std::uint64_t data_bytes() const { return data_bytes_; }

 private:
  friend class ShardLayout;
  std::vector<ShardItem> items_;  // offsets set, checksums 0
  std::uint64_t data_bytes_ = 0;
  std::unordered_set<std::string> names_;
  // Per item, in item order: ,"ckpt.item.<name>":"kind=... xxh3=<16 hex>"; meta_hex_[i] is
  // where item i's 16 hex digits go.
  // meta_blocks_[i]: where item i's first block checksum goes (npos: it has none). The
  // keys of format 3 of an item follow its ckpt.item key.
  std::string meta_;
  std::vector<std::size_t> meta_hex_;
  std::vector<std::size_t> meta_blocks_;
  // Per item, in item order: ,"<key>":{"dtype":...,"shape":[...],"data_offsets":[b,e]}
  std::string entries_;
  // The items' lines of HeaderDigestText in key order: line k (item by_key_[k]) spans
  // [digest_line_[k], digest_line_[k + 1]); its checksum's 16 hex digits start at
  // digest_hex_[k], its block checksums at digest_blocks_[k] (npos: none).
  std::string digest_;
  std::vector<std::size_t> digest_line_;
  std::vector<std::size_t> digest_hex_;
  std::vector<std::size_t> digest_blocks_;
  std::vector<std::uint32_t> by_key_;
  bool format3_ = false;  // some item needs format 3
};

class ShardLayout {
 public:
  // Packs `items` in the given order and sizes the header. Fails on duplicate names or an
  // item whose shape and dtype disagree with its length.
  static Result<ShardLayout> Plan(ShardMeta meta, std::vector<ShardItem> items);
  // Holds `items` without planning them; PlanInPlace() plans later (the daemon defers the
  // work from the Snapshot call to a copy thread).
  static ShardLayout Unplanned(ShardMeta meta, std::vector<ShardItem> items);
  // The items of `tensors` (offsets planned, checksums to be set) followed by `blobs`, planned
  // by PlanInPlace() in time linear in the blobs. No blob may share a name with a tensor.
  static ShardLayout Unplanned(ShardMeta meta, std::shared_ptr<const TensorPlan> tensors,
                               std::vector<ShardItem> blobs);
  Status PlanInPlace();
  bool planned() const { return planned_; }

  const ShardMeta& meta() const { return meta_; }
  std::vector<ShardItem>& items() { return items_; }
  const std::vector<ShardItem>& items() const { return items_; }
  // Offset of the data section in the file: a multiple of kDataAlignment.
  std::uint64_t header_bytes() const { return header_bytes_; }
  std::uint64_t data_bytes() const { return data_bytes_; }
  std::uint64_t file_bytes() const { return header_bytes_ + data_bytes_; }

  // The first header_bytes() bytes of the file, with the items' current checksums.
  std::string RenderHeader() const;

 private:
  Status PlanAfterTensors();
  std::string RenderHeaderAfterTensors() const;

  ShardMeta meta_;
  std::vector<ShardItem> items_;
  std::shared_ptr<const TensorPlan> tensors_;  // the first tensors_->items().size() of items_
  std::uint64_t header_bytes_ = 0;
  std::uint64_t data_bytes_ = 0;
  bool planned_ = false;
};

// Checks that an item's shape and dtype give exactly its length in bytes.
Status CheckItemShape(const ShardItem& item);

// A shape as error messages write it: "[4096, 1024]".
std::string ShapeText(const std::vector<std::int64_t>& shape);

// A parsed shard header.
struct ShardInfo {
  ShardMeta meta;
  std::vector<ShardItem> items;  // in file order
  std::uint64_t data_start = 0;
  std::uint64_t file_bytes = 0;
  std::string format_version;  // as stored: "1" to "4"
  // Format 4: the version whose shard holds the items marked in_base.
  std::optional<std::uint64_t> base;
};

// The text the header checksum is taken of: a line of the identity, then one line per item
// in byte order of the item keys, every string length-prefixed ("<length>:<bytes>"), every
// number in decimal:
//   ckptd-shard-header 2 job <n>:<job> version <v> rank <r> world_size <w> session <n>:<s>
//   item <n>:<key> <tensor|blob> <DTYPE> [<d0>,<d1>,...] <begin> <end> <xxh3 hex>
// When an item needs format 3, the first line says "ckptd-shard-header 3" and each item's
// line goes on, before its newline, with what it has of
//   " layout <n>:<EncodeLayout>", " for_rank <r>", " blocks <block bytes> <16 hex>..."
// A differential shard's first line says "ckptd-shard-header 4" and ends " base <version>";
// an item whose bytes are in the base has "base <length>" where "<begin> <end>" would be.
// Readers rebuild it from the parsed header, so key order and white space in the JSON do
// not matter, only what the header says.
std::string HeaderDigestText(const ShardMeta& meta, const std::vector<ShardItem>& items,
                             std::optional<std::uint64_t> base = std::nullopt);
std::uint64_t HeaderChecksum(const ShardMeta& meta, const std::vector<ShardItem>& items,
                             std::optional<std::uint64_t> base = std::nullopt);

// The header of a differential shard of `meta` whose base is version `base` (lower than
// meta.version): `items` are all of the version's items with their checksums (and any fields
// of format 3), in_base marking those left to the base. The others are packed in the given
// order from offset 0 (their offsets are set here) and make up *data_bytes. Returns the
// first bytes of the file (size prefix and JSON, padded to a multiple of kDataAlignment).
// InvalidArgument for what ShardLayout::Plan refuses, or a base not below the version.
Result<std::string> RenderDifferentialHeader(const ShardMeta& meta, std::uint64_t base,
                                             std::vector<ShardItem>& items, std::uint64_t* data_bytes);

// Parses and validates the header of the shard at `path` (safetensors structure, our
// metadata, offsets covering the data section exactly, file size, the header checksum).
// Reads no data. The file is opened as common/safe_file.h says: a FIFO, device, directory
// or symbolic link there is DataLoss naming it, and nothing blocks.
Result<ShardInfo> ReadShardHeader(const std::string& path);
// The same from an open descriptor of the shard (not O_DIRECT); `path` names it in errors.
Result<ShardInfo> ReadShardHeader(int fd, const std::string& path);

// Parses a header given as the bytes after the 8-byte prefix; `file_bytes` is the size of
// the whole file. Exposed for tests.
Result<ShardInfo> ParseShardHeader(std::string_view json, std::uint64_t file_bytes);

// Reads every item of the shard and checks its checksum, and its block checksums if it has
// them. Returns the first mismatch.
Status VerifyShard(const std::string& path);

}  // namespace ckpt
