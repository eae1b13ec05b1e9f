// A shard open for reading its items' bytes, wherever they are: in the shard's own file, or,
// for a differential shard (format 4, format/shard_format.h), in its base version's shard of
// the same rank, in the sibling version directory:
//
//   ROOT/JOB/v0000000047/rank-00003.safetensors   ckpt.base "40": the items that changed
//   ROOT/JOB/v0000000040/rank-00003.safetensors   the full shard the others are read from
//
// Opening a differential shard opens its base too and checks it: a full shard (a base is
// never itself differential, so a read follows at most one reference) of the same job, rank
// and world size, whose version is the one named, holding every item left to it with the same
// kind, dtype, shape, length and checksum. Any difference is DataLoss naming both files:
// what the base holds is then not what the version recorded. The bytes themselves are checked
// by the readers as for any shard (the item checksums are the version's own).
//
// Both files stay open, so what is read is what was checked, whatever is renamed over the
// paths meanwhile. Not thread-safe to open; Read() may be called from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "format/shard_format.h"

namespace ckpt {

class ShardFiles {
 public:
  // Opens the shard at `path`, and its base if it is differential.
  static Result<ShardFiles> Open(const std::string& path);
  // The same for a shard already open as `fd`, whose header is `info`.
  static Result<ShardFiles> Adopt(UniqueFd fd, ShardInfo info, const std::string& path);

  // The path of the base of a differential shard at `path` whose base is version `base`.
  static std::string BasePath(const std::string& path, std::uint64_t base);

  const ShardInfo& info() const { return info_; }
  const std::string& path() const { return path_; }
  bool differential() const { return info_.base.has_value(); }
  // The shard's own descriptor (not O_DIRECT).
  int fd() const { return fd_.get(); }
  // The base's path ("" if not differential).
  const std::string& base_path() const { return base_path_; }

  // Where item `i` (of info().items) is: the descriptor, the file offset of its first byte,
  // and the path to name in errors.
  struct Location {
    int fd;
    std::uint64_t offset;
    const std::string* path;
  };
  Location Locate(std::size_t i) const;

  // Reads `n` bytes of item `i` from byte `from` of the item into `out`; IoError naming the
  // file, or DataLoss if it ends early.
  Status Read(std::size_t i, std::uint64_t from, char* out, std::size_t n) const;

  // Bytes held in the shard's own file, and in all (its items' lengths).
  std::uint64_t stored_bytes() const;
  std::uint64_t item_bytes() const;

 private:
  std::string path_, base_path_;
  UniqueFd fd_, base_fd_;
  ShardInfo info_;
  std::uint64_t base_data_start_ = 0;
  std::vector<std::uint64_t> base_offset_;  // per item: its offset in the base's data (in_base only)
};

}  // namespace ckpt
