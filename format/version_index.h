// The per-version index, ROOT/JOB/v0000000042/index.json: every global tensor of a committed
// version with its chunks across ranks and files, every rank-private item and every blob,
// so that a reader (a restore at another world size, ckptctl export, Python) finds a piece
// without opening every shard's header. It is written on the persistent tier before
// COMMITTED (see daemon/catalog/version_index_writer.h), for every version, with layouts or
// without. Human-readable JSON, one chunk, item or blob a line:
//
//   {"format": "ckptd-index/1", "job": "J", "version": 42, "world_size": 4,
//    "tensors": {"<global name>": {"dtype": "F32", "shape": [1024, 512], "replicated": false,
//       "chunks": [{"rank": 0, "file": "rank-00000.safetensors", "key": "<safetensors key>",
//                   "offsets": [0, 0], "shape": [256, 512]}, ...]}, ...},
//    "private": {"0": [{"name": "step", "file": "rank-00000.safetensors", "key": "step",
//                       "dtype": "I64", "shape": [1]}], ...},
//    "blobs": [{"rank": 0, "name": "rng", "file": "rank-00000.safetensors", "key": "__blob__/rng",
//               "bytes": 5, "for_rank": null}, ...]}
//
// A replicated tensor lists one chunk per rank that holds it (offsets 0, shape the global
// shape). "private" lists only ranks that have such items. Pure; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "format/dtype.h"
#include "format/shard_format.h"

namespace ckpt {

inline constexpr std::string_view kIndexFormat = "ckptd-index/1";
// The largest index a reader parses (an index of 10,000 ranks of 1,000 chunks each is
// about 1.3 GB).
inline constexpr std::uint64_t kMaxIndexBytes = std::uint64_t{4} << 30;

struct IndexChunk {
  std::uint32_t rank = 0;
  std::string file;  // the shard's file name in the version directory
  std::string key;   // the item's safetensors key there
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> shape;

  bool operator==(const IndexChunk&) const = default;
};

struct IndexTensor {
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;
  bool replicated = false;
  std::vector<IndexChunk> chunks;  // by rank, then by the item's place in its shard

  bool operator==(const IndexTensor&) const = default;
};

struct IndexItem {
  std::string name;
  std::string file;
  std::string key;
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;

  bool operator==(const IndexItem&) const = default;
};

struct IndexBlob {
  std::uint32_t rank = 0;
  std::string name;
  std::string file;
  std::string key;
  std::uint64_t bytes = 0;
  std::optional<std::uint32_t> for_rank;

  bool operator==(const IndexBlob&) const = default;
};

struct VersionIndex {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t world_size = 0;
  std::map<std::string, IndexTensor> tensors;                     // by global name
  std::map<std::uint32_t, std::vector<IndexItem>> private_items;  // by rank
  std::vector<IndexBlob> blobs;                                   // by rank, then shard order

  bool operator==(const VersionIndex&) const = default;

  // The file's text (see above), ending with a newline.
  std::string Render() const;
  // Parses and checks an index: the schema above and nothing else, names as shards allow
  // them, ranks below the world size, file names the canonical ones of their ranks, every
  // chunk a box within its tensor's shape, a replicated tensor's chunks the whole tensor.
  // DataLoss saying where and what is wrong ("index.json: tensors.\"w\".chunks[3]: ...").
  static Result<VersionIndex> Parse(std::string_view text);
  // Builds the index of a version from the parsed headers of all its shards (one per rank of
  // the world size, any order). FailedPrecondition naming the global tensor and the ranks
  // when ranks disagree on a global tensor (dtype, global shape, replicated) or its chunks
  // overlap or leave part of it uncovered; InvalidArgument when the shards are not one
  // version's (another job, version or world size, a rank missing or twice).
  static Result<VersionIndex> Build(const std::vector<ShardInfo>& shards);
};

// Build, one shard at a time, so that a caller holds one parsed header at once.
class VersionIndexBuilder {
 public:
  // The first shard added fixes the job, version and world size.
  Status Add(const ShardInfo& shard);
  // Checks that every rank was added and the global tensors (see VersionIndex::Build).
  Result<VersionIndex> Finish() &&;

 private:
  VersionIndex index_;
  std::vector<bool> seen_;
  std::size_t added_ = 0;
};

}  // namespace ckpt
