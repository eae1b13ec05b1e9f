// Differential versions on the persistent tier (--persistent-base-every N): a shard whose
// items mostly did not change since a base version is written with only the changed ones
// (format 4, format/shard_format.h), the rest read from the base's shard by every reader
// (format/shard_files.h). The node-local and memory tiers keep whole shards.
//
// A base is a version whose shard of the rank this daemon persisted whole and which has
// committed; a shard is written whole, and becomes a base, when no base is less than N
// versions old, or when less than half of its bytes are unchanged (then reading two files
// buys little). Unchanged means the same key, kind, dtype, shape and length, and the same
// xxh3-64 checksum, which the copy computed anyway: nothing is trusted that the bytes did not
// say.
//
// Retention must not delete a base while a version it keeps reads from it. Before a shard
// is written over base B, its daemon creates ROOT/JOB/vB/ref.v<version>.<owner> and then
// checks that B is still committed; retention (Catalog::ApplyRetention) looks for such
// references before it removes B's COMMITTED and again after, putting it back if one
// appeared in between. One of the two sides always sees the other, so a differential shard
// never commits over a base that is being deleted (docs/DESIGN-NOTES.md, "Differential
// versions on the persistent tier"). A reference whose version directory is gone is stale
// and removed by retention. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "daemon/catalog/catalog.h"
#include "daemon/io/storage.h"
#include "format/shard_format.h"

namespace ckpt {

// How to write one shard differential: its header, then the listed bytes of the whole shard.
struct DifferentialPlan {
  std::uint64_t base = 0;
  std::string header;  // the differential shard's first bytes, padded to kDataAlignment
  struct Range {
    std::uint64_t from = 0;  // offset in the whole shard's file
    std::uint64_t length = 0;
  };
  std::vector<Range> ranges;  // written in order after the header
  std::uint64_t file_bytes = 0;
  std::uint64_t stored_bytes = 0;  // of the items, in this file
  std::uint64_t item_bytes = 0;    // of all items
  // The reference that keeps the base.
  std::string ref_path;
  // The source file the plan was made from (st_dev, st_ino; 0, 0 for a memory image): the
  // copy refuses another file renamed over its path since.
  std::uint64_t source_dev = 0, source_ino = 0;
};

// The plan to write the shard `full` (its parsed header) over `base` (the base's), or nullopt
// if less than half of the item bytes are unchanged.
std::optional<DifferentialPlan> PlanDifferential(const ShardInfo& full, const ShardInfo& base);

class BaseChooser {
 public:
  // base_every 0: every shard is written whole.
  BaseChooser(std::shared_ptr<Storage> storage, const Catalog& catalog, std::uint32_t base_every)
      : storage_(std::move(storage)), catalog_(catalog), base_every_(base_every) {}

  std::uint32_t base_every() const { return base_every_; }

  // How to write the persistent shard whose whole header is `full`: differential over a base,
  // its reference created and the base found still committed after it; or nullopt, whole.
  std::optional<DifferentialPlan> Plan(const ShardInfo& full) EXCLUDES(mu_);
  // The shard of `meta` was persisted whole: a base for later versions once it commits.
  void PersistedWhole(const ShardMeta& meta) EXCLUDES(mu_);

 private:
  using Key = std::pair<std::string, std::uint32_t>;  // job, rank
  // A base's header, and the file it was read from (a committed version's shard is never
  // replaced, so the same file holds the same header; a rollback may number another file so).
  struct BaseFile {
    std::uint64_t version = 0;
    std::shared_ptr<const ShardInfo> info;
    std::uint64_t dev = 0, ino = 0, size = 0;
    std::int64_t mtime_ns = 0;
  };
  // The base's header, read from the persistent tier when its file is not the one cached.
  std::optional<BaseFile> BaseHeader(const ShardMeta& full, std::uint64_t base) EXCLUDES(mu_);

  const std::shared_ptr<Storage> storage_;
  const Catalog& catalog_;
  const std::uint32_t base_every_;
  Mutex mu_;
  std::map<Key, std::deque<std::uint64_t>> whole_ GUARDED_BY(mu_);  // newest last, a few
  std::map<Key, BaseFile> headers_ GUARDED_BY(mu_);
};

}  // namespace ckpt
