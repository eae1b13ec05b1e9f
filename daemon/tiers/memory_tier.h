// MemoryTier: the newest versions of each rank's shard, kept whole in daemon memory.
//
// Each kept shard is a MemoryImage: the exact bytes of its safetensors file (header, data),
// filled by the flush engine's writers as they write the same chunks to the first storage
// tier, so keeping it costs a memcpy and no extra read. A trainer that crashed and restarts
// while the daemon lives restores from here without reading a file; promotion to the
// persistent tier writes from here instead of reading the local file back.
//
// Bounded twice: at most `versions` committed versions per (job, rank), and at most
// `budget` bytes in all (images and the freed buffers kept for reuse). The rule of every
// tier holds for ranks with a live session: an image is dropped only once a newer committed
// version of its (job, rank) is here, or when its version failed or can no longer commit.
// Images of ranks with no live session (unregistered, or the trainer gone) stay while there
// is room, since they serve a restart's restore from memory, but give way when a shard
// does not fit otherwise: the least recently used finished job goes first (used: written
// or read by a restore or a promotion). A shard that still does not fit is not kept (its
// restore reads a file), and the log says what holds the budget.
//
// Replicas: images of shards another daemon captured and sent here
// (daemon/replication/) live in the same budget, marked with their origin. They give way
// before any shard of this daemon's own: an own shard short of room drops replicas (least
// recently used rank first, its oldest version first) before images of finished jobs; a
// replica short of room drops older replicas only (its own rank's older versions first,
// then other ranks'), never an own shard, and is refused otherwise. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "format/shard_format.h"

namespace ckpt {

struct MemoryImage {
  MemoryImage(ShardMeta meta, std::uint64_t file_bytes, char* data, std::uint64_t capacity)
      : meta(std::move(meta)), file_bytes(file_bytes), data_(data), capacity_(capacity) {}
  const ShardMeta meta;
  const std::uint64_t file_bytes;  // the file's exact size
  // Page-aligned, capacity() bytes (file_bytes rounded up to 4 KiB, zero padded): usable as
  // an O_DIRECT write buffer.
  char* data() const { return data_; }
  std::uint64_t capacity() const { return capacity_; }
  // Every byte is in place (set when the shard is published on its first tier).
  std::atomic<bool> complete{false};

 private:
  char* data_;
  std::uint64_t capacity_;
};

class MemoryTier {
 public:
  // Whether (job, rank) has a live session (a registered trainer that is still running).
  using LiveCheck = std::function<bool(const std::string& job, std::uint32_t rank)>;
  // Without `is_live`, every rank counts as live: nothing is taken from another rank.
  MemoryTier(std::uint64_t budget_bytes, std::uint32_t versions, LiveCheck is_live = nullptr);
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  bool enabled() const { return budget_ > 0 && versions_ > 0; }

  // An image for a new shard of `file_bytes` bytes, or null if it does not fit without
  // dropping an image the rules keep. Replaces an older image of the same (job, version,
  // rank), which belongs to a version that will now be rewritten.
  std::shared_ptr<MemoryImage> Reserve(const ShardMeta& meta, std::uint64_t file_bytes);
  // A replica of a shard that `origin` (a peer's address) sent: the same, but it takes room
  // only from other replicas (see above); null if it does not fit so, or if this daemon holds
  // its own shard of that version (then *own_shard, if given, is set). `delta_base` (not 0):
  // the image is a delta composed beside this replica of the same rank, which the transfer
  // holds; then only the rank's replicas older than the new version, the base excepted, give
  // way (other ranks' replicas stay: a delta that does not fit so is refused, and the whole
  // image that follows may drop the base and others, as any whole image).
  std::shared_ptr<MemoryImage> ReserveReplica(const ShardMeta& meta, std::uint64_t file_bytes,
                                              const std::string& origin, bool* own_shard = nullptr,
                                              std::uint64_t delta_base = 0) EXCLUDES(mu_);
  // Drops the replicas of `job` that `origin` sent (every origin if empty); how many.
  std::uint32_t DropReplicas(const std::string& job, const std::string& origin) EXCLUDES(mu_);
  // The job is finished: drops its complete images of versions up to `newest_committed`
  // (the job's newest committed version), this daemon's own shards and the replicas it holds
  // for peers. A newer version is still on its way (being filled, replicated, or waiting for
  // its commit): it stays, and goes by the tier's usual rules. How many, and their bytes in
  // *bytes.
  std::uint32_t DropJob(const std::string& job, std::uint64_t newest_committed, std::uint64_t* bytes)
      EXCLUDES(mu_);
  // Bytes of replicas held, per origin.
  std::map<std::string, std::uint64_t> ReplicaBytes() EXCLUDES(mu_);
  // The image is complete (its shard is published).
  void Complete(const std::shared_ptr<MemoryImage>& image);
  // The image's shard failed: drop it.
  void Drop(const std::shared_ptr<MemoryImage>& image);
  // `version` of `job` committed: per rank, keep the newest `versions` committed images
  // and drop older ones, committed or not (an older version never commits after a newer).
  void OnCommitted(const std::string& job, std::uint64_t version);
  // A rank restored an older version (rollback): its images of newer versions are dropped
  // (own and replicas); how many.
  std::uint32_t DropNewerThan(const std::string& job, std::uint32_t rank, std::uint64_t version);

  // The complete image of (job, version, rank), or null.
  std::shared_ptr<MemoryImage> Find(const std::string& job, std::uint64_t version, std::uint32_t rank);
  // The complete replica of (job, version, rank) that `origin` sent, or null (none, or the
  // image there is this daemon's own or another origin's).
  std::shared_ptr<MemoryImage> FindReplica(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                           const std::string& origin) EXCLUDES(mu_);
  // Ranks with a complete image of this daemon's own (not a replica), per version of `job`.
  std::map<std::uint64_t, std::vector<std::uint32_t>> List(const std::string& job);
  // The complete replicas of `job` that peers sent, per version: (rank, origin), by rank.
  std::map<std::uint64_t, std::vector<std::pair<std::uint32_t, std::string>>> ListReplicas(
      const std::string& job) EXCLUDES(mu_);
  // The complete replicas of `job` that `origin` sent, as (version, rank, file bytes), by
  // rank then version: what a warm start of the node at `origin` may pull back.
  struct ReplicaEntry {
    std::uint64_t version = 0;
    std::uint32_t rank = 0;
    std::uint64_t file_bytes = 0;
  };
  std::vector<ReplicaEntry> ReplicasFrom(const std::string& job, const std::string& origin) EXCLUDES(mu_);

  struct Stats {
    std::uint64_t images = 0;
    std::uint64_t bytes = 0;  // held by images and by freed buffers kept for reuse
    std::uint64_t budget = 0;
  };
  Stats GetStats();
  // What the budget in use is made of, so that it adds up: accounted == held + in_flight +
  // reusable. Held: complete images (a shard's whole file, as a restore reads it), per job,
  // this daemon's own and replicas apart. In flight: images still being filled by a shard's
  // writes, and images dropped from the tier that a restore or a promotion still reads.
  // Reusable: freed buffers kept for the next image of their size (no shard's bytes).
  struct JobUsage {
    std::uint64_t shards = 0, bytes = 0;                  // this daemon's own shards
    std::uint64_t replica_shards = 0, replica_bytes = 0;  // replicas peers sent
  };
  struct Usage {
    std::map<std::string, JobUsage> jobs;
    std::uint64_t held = 0, in_flight = 0, reusable = 0, accounted = 0, budget = 0;
  };
  Usage GetUsage() EXCLUDES(mu_);
  // Bytes of the complete image of (job, version, rank) of this daemon's own that the tier
  // holds (its buffer's capacity, as the budget counts it); 0 if none.
  std::uint64_t HeldBytes(const std::string& job, std::uint64_t version, std::uint32_t rank) EXCLUDES(mu_);
  std::uint32_t versions() const { return versions_; }

 private:
  using Key = std::tuple<std::string, std::uint32_t>;  // (job, rank)
  struct Entry {
    std::shared_ptr<MemoryImage> image;
    bool committed = false;
    std::string origin;  // a replica's sender; empty for this daemon's own shards
  };
  // Drops one replica to make room (least recently used rank first, its oldest version
  // first; `prefer` first when it holds one older than `below`, and never one of `prefer`'s
  // as new as `below` or newer); false if there is none.
  bool DropOneReplicaLocked(const Key& prefer, std::uint64_t below) REQUIRES(mu_);
  // Drops `key`'s oldest replica older than `below` other than version `keep`; whether one was.
  bool DropOlderReplicaLocked(const Key& key, std::uint64_t below, std::uint64_t keep) REQUIRES(mu_);
  std::shared_ptr<MemoryImage> MakeImage(const ShardMeta& meta, std::uint64_t file_bytes, char* data,
                                         std::uint64_t bytes, std::uint64_t capacity);
  // The memory itself: buffers in use and freed ones kept for reuse. Shared with the
  // images' deleters, since an image in use (a restore, a promotion) may outlive its entry.
  struct Store;
  void PruneLocked(std::map<std::uint64_t, Entry>& versions);
  void TouchLocked(const Key& key) REQUIRES(mu_) { last_used_[key] = ++use_clock_; }
  // Drops images of finished ranks, least recently used job first, until a buffer of
  // `bytes` is had (returned, with *capacity) or none is left to drop (nullptr).
  char* TakeFromFinished(const ShardMeta& meta, std::uint64_t bytes, std::uint64_t* capacity) EXCLUDES(mu_);
  // Says (rate-limited) why a shard is not kept: what holds the budget.
  void WarnNotKept(const ShardMeta& meta, std::uint64_t file_bytes) EXCLUDES(mu_);

  const std::uint64_t budget_;
  const std::uint32_t versions_;
  const LiveCheck is_live_;
  std::shared_ptr<Store> store_;
  Mutex mu_;
  std::map<Key, std::map<std::uint64_t, Entry>> images_ GUARDED_BY(mu_);
  // When each (job, rank) was last written or read, on a counter of uses.
  std::map<Key, std::uint64_t> last_used_ GUARDED_BY(mu_);
  std::uint64_t use_clock_ GUARDED_BY(mu_) = 0;
  // Shards not kept since the last warning, and when it was.
  std::uint64_t not_kept_ GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point warned_ GUARDED_BY(mu_){};
};

}  // namespace ckpt
