// TierSet: the daemon's tiers seen together, fastest first: the memory tier (newest
// versions kept whole), the local tier (optional) and the persistent tier (the Catalog's
// tree, where commits happen). It answers "which is the fastest tier holding this shard",
// holds a committed version against every tier's retention while it is read, lists a job's
// versions across tiers, and prefetches a committed version from the persistent tier into
// the faster ones. Memory and local hold only what this daemon wrote or prefetched; once a
// version is committed any copy of a shard is the committed one (checksums are verified on
// every read). Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/shard_copier.h"
#include "daemon/tiers/local_tier.h"
#include "daemon/tiers/memory_tier.h"

namespace ckpt {

// kPeer: a replica in a peer daemon's memory, read over the network.
enum class Tier { kMemory, kLocal, kPersistent, kPeer };
const char* TierName(Tier tier);  // "memory", "local", "persistent", "peer"
// The order of speed, which is not the enum's: memory, local, peer, persistent. True when
// `a` is faster than `b`.
bool FasterTier(Tier a, Tier b);
// The slower of the two.
inline Tier SlowerTier(Tier a, Tier b) { return FasterTier(a, b) ? b : a; }
// Whether a restore that failed to read a copy on `tier` with `st` goes on with the next copy:
// a bad (DATA_LOSS) or missing (NOT_FOUND: retention removed it after it was listed) copy on
// a faster tier, and an IO_ERROR where the caller knows it is the copy's (`io_error_is_copy`:
// a read, not a write to the trainer's regions). The persistent tier's copy is the last one.
bool WorthNextCopy(const Status& st, Tier tier, bool io_error_is_copy);

// Keeps a version from every tier's retention while it lives.
class VersionHold {
 public:
  VersionHold(Catalog& catalog, LocalTier* local, std::string job, std::uint64_t version);
  ~VersionHold();
  VersionHold(const VersionHold&) = delete;
  VersionHold& operator=(const VersionHold&) = delete;

 private:
  Catalog& catalog_;
  LocalTier* local_;
  const std::string job_;
  const std::uint64_t version_;
};

// The shards that peer daemons hold in memory (daemon/replication/Replicator).
class PeerShards {
 public:
  virtual ~PeerShards() = default;
  // The peers holding a complete image of (job, version, rank), in the order to try them
  // (the peer rule's holders first). Reports the rule's holders that do not have it.
  virtual std::vector<std::string> Holding(const std::string& job, std::uint64_t version, std::uint32_t rank) = 0;
  // The image, read from `peer` and checked piece by piece (its items are verified by the
  // restore); an error saying why if it cannot be had.
  virtual Result<std::shared_ptr<MemoryImage>> Fetch(const std::string& peer, const std::string& job,
                                                     std::uint64_t version, std::uint32_t rank) = 0;
  // Whether some peer holds (job, version, rank) as written by `registration` (the ring in
  // order, stopping at the first; nothing reported).
  virtual bool AnyHolds(const std::string& job, std::uint64_t version, std::uint32_t rank,
                        const std::string& registration) = 0;
  // A restore of `version` of (job, rank) left the timeline above it: every peer drops its
  // images of that rank above it (replicas left by the old timeline would otherwise be
  // read for the new one's versions of the same numbers). Peers that do not answer are logged.
  virtual void DropNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) = 0;
};

// A committed version, held.
struct HeldVersion {
  std::uint64_t version = 0;
  std::uint64_t latest = 0;  // the job's newest committed version
  std::unique_ptr<VersionHold> hold;
};

// Where one shard is read from.
struct ShardSource {
  Tier tier = Tier::kPersistent;
  std::shared_ptr<MemoryImage> image;  // kMemory
  std::string path;                    // kLocal, kPersistent
  bool direct_io = false;
  std::string peer;  // kPeer: the peer's address; `image` is filled by FetchFromPeer
};

// A version as the tiers hold it.
struct VersionOnTiers {
  bool committed = false;
  bool restorable = false;  // not committed, but every rank's shard is replicated
  std::string aborted;      // non-empty: a rank aborted it, and why
  std::string under_replicated;  // non-empty: committed without every shard replicated, and why
  std::vector<std::uint32_t> persistent_ranks;  // ranks with a durable shard there
  std::vector<std::uint32_t> local_ranks;
  std::vector<std::uint32_t> memory_ranks;  // this daemon's own images
  // Replicas held here for other daemons: (rank, the daemon that sent it).
  std::vector<std::pair<std::uint32_t, std::string>> replicas_held;
};

struct PrefetchResult {
  std::uint64_t version = 0;
  std::uint32_t ranks = 0;
  std::uint32_t local_shards = 0;   // copied to the local tier
  std::uint32_t memory_shards = 0;  // loaded into the memory tier
  std::uint64_t bytes = 0;          // read from the persistent tier
  std::uint32_t differential_shards = 0;  // left on the persistent tier (restores read them there)
};

class TierSet {
 public:
  // `local` may be null (no local tier). `persistent_direct_io`: the root takes O_DIRECT.
  TierSet(std::shared_ptr<Storage> storage, Catalog& catalog, bool persistent_direct_io, LocalTier* local,
          MemoryTier& memory, ShardCopier& copier, std::uint64_t read_piece_bytes)
      : storage_(std::move(storage)),
        catalog_(catalog),
        persistent_direct_io_(persistent_direct_io),
        local_(local),
        memory_(memory),
        copier_(copier),
        read_piece_bytes_(read_piece_bytes) {}

  Catalog& persistent() { return catalog_; }
  bool persistent_direct_io() const { return persistent_direct_io_; }
  LocalTier* local() { return local_; }
  MemoryTier& memory() { return memory_; }

  // The committed version `requested` (0: the newest) of `job`, held; NotFound saying why
  // if there is none. Reads the shared directory (another node may have committed).
  Result<HeldVersion> HoldCommitted(const std::string& job, std::uint64_t requested);
  // Peers' memory as a source of restores (null: none). Set once, before serving.
  void SetPeers(PeerShards* peers) { peers_ = peers; }
  PeerShards* peers() { return peers_; }
  // Reads a kPeer source's image from its peer.
  Result<std::shared_ptr<MemoryImage>> FetchFromPeer(const ShardSource& src, const std::string& job,
                                                     std::uint64_t version, std::uint32_t rank);
  // The tiers holding (job, version, rank), fastest first; the persistent tier always comes
  // last (its file may be missing: the read says so). With peers and no image in
  // this daemon's memory, each peer holding one comes after the local tier, in the order
  // PeerShards::Holding gives. `ask_peers` false: this daemon's own tiers only (no call to
  // any peer). `registration` (a version not committed yet, which two runs may have written): a memory image of
  // another registration is no source, and does not stop the peers being asked.
  std::vector<ShardSource> Sources(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                   bool ask_peers = true, const std::string* registration = nullptr);
  // A copy on a faster tier failed verification: drops it, so that later reads go to the
  // next tier. The persistent tier's copy is never dropped here.
  void DropCopy(const ShardSource& copy);
  // Every version of `job` on any tier.
  Result<std::map<std::uint64_t, VersionOnTiers>> List(const std::string& job);
  // Copies `ranks` (empty: every rank) of a committed version (0: the newest) to the local
  // tier and into the memory tier, where each is missing.
  Result<PrefetchResult> Prefetch(const std::string& job, std::uint64_t requested,
                                  std::vector<std::uint32_t> ranks);

 private:
  // Reads the shard file `path` into `image` (its file_bytes).
  Status Load(const std::string& path, bool direct_io, MemoryImage& image);

  const std::shared_ptr<Storage> storage_;
  Catalog& catalog_;
  const bool persistent_direct_io_;
  LocalTier* const local_;
  MemoryTier& memory_;
  ShardCopier& copier_;
  const std::uint64_t read_piece_bytes_;
  PeerShards* peers_ = nullptr;
};

}  // namespace ckpt
