// ShardCopier: copies a published shard to another tier (local -> persistent promotion,
// persistent -> local prefetch) the way the flush engine writes: aligned pieces, several
// in flight (O_DIRECT where the directories take it), a .tmp file, fdatasync, rename,
// fsync of the directory. The source is a file, or the shard's memory-tier image (then
// nothing is read from disk). With a differential plan (daemon/pipeline/differential.h) the
// file written is the plan's header followed by the listed bytes of the source, gathered
// into pool chunks. A committed version is never overwritten. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/differential.h"
#include "daemon/pipeline/host_pool.h"
#include "daemon/tiers/memory_tier.h"

namespace ckpt {

class ShardCopier {
 public:
  ShardCopier(std::shared_ptr<Storage> storage, HostPool& pool, unsigned streams)
      : storage_(std::move(storage)), pool_(pool), streams_(streams == 0 ? 1 : streams) {}

  struct Source {
    std::string path;                    // the shard file (used when image is null)
    bool direct_io = false;              // read it with O_DIRECT
    std::shared_ptr<MemoryImage> image;  // or its complete memory-tier image
    std::uint64_t file_bytes = 0;        // the shard's size
  };
  struct Target {
    std::string dir;   // version directory (created if missing)
    std::string name;  // file name in it
    bool direct_io = false;
    std::uint64_t version = 0;  // for the test pause point "promote"
    // When it turns true, the copy stops at its next piece (kCancelled, no file left).
    const std::atomic<bool>* abandon = nullptr;
    // Write the shard differential, as this plan says (null: a copy of the source).
    const DifferentialPlan* differential = nullptr;
  };

  // Copies and publishes; returns the bytes read from disk (0 from an image).
  Result<std::uint64_t> Copy(const Source& src, const Target& dst);


 private:
  std::shared_ptr<Storage> storage_;
  HostPool& pool_;
  unsigned streams_;
};

}  // namespace ckpt
