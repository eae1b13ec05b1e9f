// RestoreEngine: fills a trainer's registered regions from a committed shard.
//
// In: the shard path and the trainer's tensor items with their regions. Out: bytes in the
// regions, the blob items, or an error naming the first mismatch (a missing or extra item,
// another dtype, shape or size, a checksum that does not match). The layout is checked
// against the registration before any byte is written; checksums are checked as the bytes
// stream through, so after a DataLoss error the regions hold partial data and the trainer
// must not train on them. Reads go through pool chunks (O_DIRECT where the directory
// takes it), several in flight, from the 4 KiB boundary at or before the data section, so
// a valid shard whose data is not aligned restores too. The header and the data come from
// one file (see common/safe_file.h for how it is opened). Thread-safe; concurrent restores
// share the pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

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
};

struct RestoredShard {
  std::vector<std::pair<std::string, std::string>> blobs;  // name, bytes
  std::uint64_t tensor_bytes = 0;
  std::uint64_t bytes_read = 0;
};

class RestoreEngine {
 public:
  RestoreEngine(std::shared_ptr<Storage> storage, HostPool& pool, unsigned readers)
      : storage_(std::move(storage)), pool_(pool), readers_(readers) {}

  Result<RestoredShard> Restore(const std::string& path, const std::vector<RestoreTarget>& targets,
                                bool direct_io);
  // The same from a complete memory-tier image: no file is read (bytes_read stays 0).
  Result<RestoredShard> RestoreFromImage(const MemoryImage& image, const std::vector<RestoreTarget>& targets);

 private:
  std::shared_ptr<Storage> storage_;
  HostPool& pool_;
  unsigned readers_;
};

}  // namespace ckpt
