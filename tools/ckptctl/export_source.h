// The version an export reads (export.h): which one, its tensors as its index.json (or its
// shard headers) lists them, and its shards, open for the copies. Shared by the files of the
// export (export_source.cc reads, export_plan.cc checks and packs, export_copy.cc copies,
// export.cc writes); not part of export.h's interface.
//
// Not thread-safe: one export at a time, on one thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/names.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "format/shard_files.h"
#include "format/shard_format.h"
#include "tools/ckptctl/export.h"

namespace ckptctl::export_internal {

// No tensor of more bytes than this is believed (an index could claim any shape); far above
// any real one, and small enough that offsets of files holding several never wrap 64 bits.
inline constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 56;

// Elements of `shape`, or nullopt if a dimension is negative or the bytes pass kMaxTensorBytes.
std::optional<std::uint64_t> Elements(const std::vector<std::int64_t>& shape, std::size_t element_bytes);

// For messages: a name quoted, a box "[0:4, 2:6]", a shape "[4,8]".
inline std::string Quote(const std::string& name) { return ckpt::QuoteName(name); }
std::string BoxText(const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& shape);
std::string ShapeText(const std::vector<std::int64_t>& shape);

// One rank's shard, open, with its header parsed from the same descriptor (what is read is the
// file that was checked, whatever is renamed over the path meanwhile), and for a differential
// shard its base, open too (format/shard_files.h).
struct OpenShard {
  std::string path;
  ckpt::ShardFiles files;
  ckpt::ShardInfo info;
  std::unordered_map<std::string, std::size_t> by_key;  // TensorKey() -> index in info.items
};

// The shards of one version, opened on first use and kept open for the copies.
class ShardSet {
 public:
  ShardSet(std::string version_dir, std::string job, std::uint64_t version, std::uint32_t world_size)
      : dir_(std::move(version_dir)), job_(std::move(job)), version_(version), world_size_(world_size) {}

  // Rank `rank`'s shard, opened and its header checked to be (job, version, rank) of the
  // world size on the first call. DataLoss naming the rank or the path when it cannot be
  // opened, fails its header's checks or is another shard.
  ckpt::Result<OpenShard*> Get(std::uint32_t rank);

 private:
  std::string dir_, job_;
  std::uint64_t version_;
  std::uint32_t world_size_;
  std::map<std::uint32_t, std::unique_ptr<OpenShard>> shards_;
};

// The tensors of `version` of `job` under `root` (0: the newest committed), as LoadExportSource
// says, not yet checked against the shards (CheckAgainstShards), so that an export checks only
// the shards of what it exports. *shards_out gets the version's shards.
ckpt::Result<ExportSource> LoadVersion(const std::string& root, const std::string& job, std::uint64_t version,
                                       std::unique_ptr<ShardSet>* shards_out);

// Every chunk names an item of its shard of the dtype and shape the index gives it (the
// header checksum vouches for what the header says, so this catches an index that is wrong).
ckpt::Status CheckAgainstShards(ShardSet& shards, const ExportSource& src);

}  // namespace ckptctl::export_internal
