// The work of one ElasticRestore call (elastic_restore.h), shared by its two files:
// elastic_plan.cc reads the headers of the shards the registration needs and plans the pieces
// to copy; elastic_restore.cc reads and verifies the pieces and writes the regions. Not part
// of elastic_restore.h's interface.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "format/shard_files.h"
#include "daemon/base/error_log.h"
#include "daemon/io/storage.h"
#include "daemon/session/elastic_restore.h"
#include "daemon/pipeline/tier_set.h"
#include "format/box.h"
#include "format/shard_format.h"

namespace ckpt::elastic_internal {

// A read task covers at most this many blocks: pieces of a large chunk are read, verified
// and copied on several threads.
constexpr std::uint64_t kTaskBlocks = 16;
// A task reads at most this much at once, whatever the shard claims an item's or a block's
// size to be: a reader thread's buffer never grows past it. Blocks larger than this (no
// writer of ours makes them) are not used: such an item is verified whole, streamed.
constexpr std::uint64_t kReadWindow = 16ull << 20;

// Every failure here is a read of a copy (the regions are written after all reads), so an
// IO_ERROR is the copy's.
inline bool WorthNextCopy(const Status& st, Tier tier) {
  return ckpt::WorthNextCopy(st, tier, /*io_error_is_copy=*/true);
}

// One rank's shard of the version, read from its fastest good copy.
struct LoadedShard {
  std::uint32_t rank = 0;
  bool loaded = false;  // the plan needs it (all of them without an index)
  bool listed = false;  // `sources` is filled (only for the shards the plan needs)
  std::vector<ShardSource> sources;
  std::size_t at = 0;  // the copy in use
  ShardInfo info;
  UniqueFd fd;  // file copies
  // A differential file copy (format/shard_files.h), its base open too; `fd` is then unused.
  std::optional<ShardFiles> files;
  std::map<std::string, const ShardItem*> tensors, blobs;

  // Where byte `lo` of item `item` (of info.items) is read from in a file copy.
  std::pair<int, std::uint64_t> FileAt(const ShardItem& item, std::uint64_t lo) const {
    if (!files) return {fd.get(), info.data_start + item.offset + lo};
    const ShardFiles::Location where = files->Locate(static_cast<std::size_t>(&item - info.items.data()));
    return {where.fd, where.offset + lo};
  }

  const ShardSource& src() const { return sources[at]; }
  std::string Where() const {
    if (src().tier == Tier::kPeer)
      return "the replica of rank " + std::to_string(rank) + " from peer " + src().peer;
    return src().image ? "the memory tier's copy of rank " + std::to_string(rank)
                       : std::string(TierName(src().tier)) + " shard " + src().path;
  }
};

// What one piece of the plan copies: `sub` of the stored item (holding `chunk`) into the
// staging buffer of a target (holding `dst`), or a blob whole.
struct Piece {
  std::size_t shard = 0;
  const ShardItem* item = nullptr;
  std::size_t target = SIZE_MAX;  // SIZE_MAX: a blob
  std::size_t blob = 0;           // index into the result's blobs
  Box chunk, sub, dst;
  std::size_t elem = 1;
  const BlockSums* blocks = nullptr;  // null: verified by the item checksum
  std::string global;                 // for messages: the global tensor and box
};

struct Task {
  std::size_t piece = 0;
  std::uint64_t lo = 0, hi = 0;  // bytes of the item
};

class ElasticRun {
 public:
  ElasticRun(Storage& storage, TierSet& tiers, ErrorLog& errors, const ElasticRequest& req, unsigned readers,
             const RestoreLimits& limits)
      : storage_(storage),
        tiers_(tiers),
        errors_(errors),
        req_(req),
        readers_(std::max(1u, readers)),
        limits_(limits) {}

  // Loads the header of rank r's shard from its fastest good copy.
  Status Load(LoadedShard& s);

  // Fills the copies of `s`, fastest first. Done only for a shard the plan reads: with peer
  // replication, listing asks every peer whether it holds one.
  void List(LoadedShard& s);

  // The fastest tier of rank r's shard that is known without asking a peer: memory or local
  // where this daemon holds it, else the persistent tier (a peer's replica is slower than
  // this daemon's own copies, and only worth asking for once the shard is needed).
  Tier LocalTierOf(std::uint32_t r);

  // A copy on a faster tier failed verification: report, drop, go on with the next.
  void BadCopy(LoadedShard& s, const Status& why);

  // Loads the shards the plan needs: those the version's index.json names for the
  // registration's boxes, replicated items (one rank, on the fastest tier), rank-private
  // items and blobs; every shard where the version has no readable index. The index only
  // chooses which headers to read: what is restored comes from the (checksummed) headers.
  // The table has an entry only for the ranks needed: a version's world size is a claim of
  // its COMMITTED marker.
  Status LoadAll();

  // Which ranks' shards the plan reads (LoadAll): from the version's index.json, or all of
  // them where it has none that is readable.
  std::vector<bool> NeededRanks();

  Status Plan(ElasticRestored& out);
  // Runs every piece; a DATA_LOSS of a copy on a faster tier is left in `bad` (per shard).
  Status Read(ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
              std::map<std::size_t, Status>& bad);

  // Rank r's shard; only for a rank the plan reads (loaded).
  LoadedShard& shard(std::size_t r) { return *shards_[r]; }
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  Status PlanTarget(std::size_t i);
  // Reads, verifies and copies one task; `data` is a buffer for a file read.
  Status RunTask(const Task& t, ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                 std::vector<char>& data, std::uint64_t& read);

  Storage& storage_;
  TierSet& tiers_;
  ErrorLog& errors_;
  const ElasticRequest& req_;
  const unsigned readers_;
  const RestoreLimits limits_;
  std::vector<std::unique_ptr<LoadedShard>> shards_;  // null: a rank the plan does not read
  std::vector<Piece> pieces_;
};

}  // namespace ckpt::elastic_internal
