// ElasticRestore: fills a registration's regions from a committed version written by
// another world size, or with another decomposition of its global tensors.
//
// In: the version (job, number, the world size W that wrote it), the restoring rank and its
// registered items, each with its layout (a box of a global tensor, replicated, or none:
// rank-private). Out: bytes in the regions, the blobs meant for this rank (each with the
// rank that wrote it), or an error that says what is wrong and that nothing was written.
//
// Steps: (1) the header of every rank's shard of the version is read from the fastest tier
// holding it (TierSet::Sources: this daemon's memory image, the local tier, the persistent
// tier) and checked to be that shard (identity and header checksum, which covers the items'
// layouts, block checksums and for_rank: format/global_layout.h). (2) A plan: for each
// item with a layout, the chunks of its global tensor that overlap its box (dtype and global
// shape must agree; pieces must not overlap and must cover the box, else the error names
// the box); a replicated item takes one whole copy, from the rank whose copy is on the
// fastest tier; a rank-private item only from its own rank at the same world size. (3) Each
// piece is read by the 1 MiB blocks it touches (coalesced into runs of at most 16 blocks, on
// up to `readers` threads) and every block read is checked against its stored xxh3; an item
// read whole (replicated, rank-private, or a shard without block checksums) is checked
// against its item checksum. Verified bytes go into staging buffers in daemon memory, one
// per registered item. (4) Only when every piece and blob is verified are the staging
// buffers written to the regions (host shm regions directly, device regions through the
// backend's copy lanes). A bad copy on the memory or local tier is reported (ErrorLog),
// dropped from its tier, and the rank's shard is read from the next tier; a bad persistent
// copy is a DATA_LOSS naming the global tensor, the box, the file or tier and the rank.
//
// What a shard claims is bounded before it is allocated (RestoreLimits): a copy whose blobs
// total more than --max-blob-mib is a bad copy, and so are the blobs of all the shards meant
// for this rank together; files are read through buffers of at most kReadWindow per reader
// thread whatever an item's or a block's size, so the daemon's memory grows with the
// registration (the staging buffers) and the blobs, never with a header's claims. A world
// size over kMaxWorldSize (format/limits.h) never gets here (ParseCommitted refuses it), and
// the table of the version's shards holds an entry only for the ranks the plan reads.
// Thread-safe; one restore per call.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/base/error_log.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/restore_engine.h"
#include "daemon/pipeline/tier_set.h"
#include "format/box.h"
#include "format/global_layout.h"

namespace ckpt {

// A registered tensor item to fill, with its layout (none: rank-private).
struct ElasticTarget {
  RestoreTarget target;
  std::optional<GlobalLayout> layout;  // resolved (ResolveLayout)
};

struct RestoredBlob {
  std::string name;
  std::string data;
  std::uint32_t from_rank = 0;  // the rank that wrote it
};

struct ElasticRequest {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t version_world_size = 0;  // W, that wrote the version
  std::uint32_t rank = 0;                // the restoring rank, of `world_size`
  std::uint32_t world_size = 0;
  std::vector<ElasticTarget> targets;
};

struct ElasticRestored {
  std::vector<RestoredBlob> blobs;
  std::uint64_t tensor_bytes = 0;
  std::uint64_t bytes_read = 0;  // from files
  // Tensor bytes restored from each tier, indexed by Tier (memory, local, persistent, peer).
  std::uint64_t tier_bytes[4] = {0, 0, 0, 0};
  Tier slowest = Tier::kMemory;  // the slowest tier read from
};

class ElasticRestore {
 public:
  ElasticRestore(std::shared_ptr<Storage> storage, TierSet& tiers, ErrorLog& errors, unsigned readers,
                 DeviceBackend* backend, unsigned lanes, RestoreLimits limits = {})
      : storage_(std::move(storage)),
        tiers_(tiers),
        errors_(errors),
        readers_(readers),
        backend_(backend),
        lanes_(lanes),
        limits_(limits) {}

  Result<ElasticRestored> Restore(const ElasticRequest& req);

  // Whether the registration's items are exactly rank `rank`'s shard of the version (same
  // items, shapes and layouts): then the plain restore of that shard serves it. Reads that
  // shard's header from its fastest tier.
  // `fetched` (if given) gets the copy read when it is a peer's replica (peer replication), fetched
  // whole, so that the fast path restores from it rather than fetching it again.
  Result<bool> MatchesOwnShard(const ElasticRequest& req, ShardSource* fetched = nullptr);

 private:
  std::shared_ptr<Storage> storage_;
  TierSet& tiers_;
  ErrorLog& errors_;
  const unsigned readers_;
  DeviceBackend* const backend_;
  const unsigned lanes_;
  const RestoreLimits limits_;
};

}  // namespace ckpt
