// RestoreEngine: fills a trainer's registered regions from a committed shard.
//
// In: the shard (its file, or its memory-tier image) and the trainer's tensor items with
// their regions. Out: bytes in the regions, the blob items, or an error naming the first
// mismatch (a missing or extra item, another dtype, shape or size, a checksum that does not
// match). The layout is checked against the registration before any byte is read.
//
// All or nothing: every item's checksum is verified before the first byte reaches a
// region, so after an error the regions hold what they held before (a DATA_LOSS says
// "nothing was written to the registered regions"). A file is read into pool chunks: as
// many as the pool lends the restore now, up to one per chunk of the shard. If it lends
// them all, the shard is read once, verified, and copied out of the very chunks it was
// verified in. Otherwise the first chunks of the shard stay in the chunks it got, but for a
// window (one chunk per read in flight) through which the rest passes twice: the first
// pass verifies every item and keeps an xxh3 of each passing chunk, the second reads those
// chunks again, checks each against its hash, and only then copies it. A file whose bytes
// changed in between is refused with an I/O error (with a failed copy, the only cases that
// leave the regions partly written, and their messages say so). A memory-tier image does
// not change: it is verified where it lies. Into device regions it is then staged chunk by
// chunk through a window of pool chunks (pinned: host-to-device copies never go through
// the driver's pageable staging) and copied from there. Into host (shm) regions it takes no
// pool chunk: its items are verified on several threads while the destination ranges are
// preallocated (ImportedRegion::Preallocate: a fresh shm object allocates its pages on
// first write), then written straight from the image, pieces of several regions at once.
//
// Copies out of the chunks go through copy lanes (backend/device_copier.h): for device
// regions, asynchronous host-to-device copies on the backend's streams, chunk k on lane
// k % lanes, one ticket (a CUDA event) per chunk and lane, a chunk given back to the pool
// once its tickets are waited for; host (shm) regions are written at once. Reads go
// through pool chunks (O_DIRECT where the directory takes it), several in flight, from the
// 4 KiB boundary at or before the data section, so a valid shard whose data is not aligned
// restores too. The header and the data come from one file (see common/safe_file.h for how
// it is opened). Thread-safe; concurrent restores share the pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/device_copier.h"
#include "backend/region_importer.h"
#include "common/status.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/tiers/memory_tier.h"
#include "format/shard_format.h"

namespace ckpt {

// A registered tensor item, as the restore needs it.
struct RestoreTarget {
  ShardItem item;  // name, dtype, shape, length
  std::shared_ptr<ImportedRegion> region;
  std::uint64_t region_offset = 0;
  // Its range's pages are allocated already (ImportedRegion::Preallocate was called for it):
  // a host restore does not allocate them again.
  bool preallocated = false;
};

// What a restore takes from a shard, checked before anything of that size is allocated: a
// shard lies in a directory its job's owner can write, so its header's sizes are claims (a
// blob of 2 GiB may be a hole of a sparse file). Tensor items must match the registration
// byte for byte (MatchLayout), so only blobs need a bound of their own.
struct RestoreLimits {
  // The blob bytes one shard, and one restore, may hand back: --max-blob-mib, what a
  // snapshot may store and what a reply can carry.
  std::uint64_t max_blob_bytes = std::uint64_t{256} << 20;
};

// Checks the blobs of `info` (named `what` in the error) against `limits`: DataLoss naming
// both if they total more, so that the restore goes on to the next copy as for a corrupt one.
Status CheckBlobBytes(const std::string& what, const ShardInfo& info, const RestoreLimits& limits);

struct RestoredShard {
  std::vector<std::pair<std::string, std::string>> blobs;  // name, bytes
  std::uint64_t tensor_bytes = 0;
  std::uint64_t bytes_read = 0;  // from files, in every pass
  // Where the time went (the restore breakdown in the daemon's log): reading and verifying
  // every item (with the destination's preallocation beside it), then the copy into the
  // regions.
  double verify_ms = 0;
  double preallocate_ms = 0;  // of verify_ms, on one of its threads (host regions only)
  double copy_ms = 0;
};

// Where a restore's bytes come from (restore_engine.cc).
struct ShardBytes;

class RestoreEngine {
 public:
  // `backend` (may be null: host regions only) makes `lanes` copy lanes per device restored to.
  RestoreEngine(std::shared_ptr<Storage> storage, HostPool& pool, unsigned readers,
                DeviceBackend* backend = nullptr, unsigned lanes = 2, RestoreLimits limits = {})
      : storage_(std::move(storage)),
        pool_(pool),
        readers_(readers),
        backend_(backend),
        lanes_(lanes),
        limits_(limits) {}

  Result<RestoredShard> Restore(const std::string& path, const std::vector<RestoreTarget>& targets,
                                bool direct_io);
  // The same from a complete memory-tier image: no file is read (bytes_read stays 0).
  Result<RestoredShard> RestoreFromImage(const MemoryImage& image, const std::vector<RestoreTarget>& targets);

  // What the elastic restore (daemon/session/elastic_restore.h) shares with this engine.
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  unsigned readers() const { return readers_; }
  DeviceBackend* backend() const { return backend_; }
  unsigned lanes() const { return lanes_; }
  const RestoreLimits& limits() const { return limits_; }

 private:
  Result<RestoredShard> Run(const std::string& what, const ShardInfo& info,
                            const std::vector<RestoreTarget>& targets, const ShardBytes& src);
  Result<RestoredShard> RestoreImageToHost(const std::string& what, const ShardInfo& info,
                                           const MemoryImage& image,
                                           const std::vector<RestoreTarget>& targets);

  std::shared_ptr<Storage> storage_;
  HostPool& pool_;
  unsigned readers_;
  DeviceBackend* backend_;
  unsigned lanes_;
  RestoreLimits limits_;
};

}  // namespace ckpt
