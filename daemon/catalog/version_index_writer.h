// VersionIndexWriter: writes a version's index.json (format/version_index.h) on the persistent
// tier, just before the commit stage writes its COMMITTED. In: the version's shards on the
// persistent tier, one per rank, and each rank's current registration. Out: the index file
// (tmp, fdatasync, rename, directory fsync, as every published file), or the reason there is
// none, which fails the commit: a version never becomes visible without its index.
//
// The index is built from the shard headers themselves, the one record that cannot disagree
// with the data (their header checksums cover the layouts): the daemon that commits reads
// every rank's header (8 + N bytes each), several at once. docs/DESIGN-NOTES.md ("Layouts,
// format 3 and the version index") weighs this against other designs; docs/BENCHMARKS.md
// ("Version index build") gives its cost at thousands of ranks. Thread-compatible: the
// catalog calls it under its commit lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/io/storage.h"
#include "format/paths.h"
#include "format/version_index.h"

namespace ckpt {

class VersionIndexWriter {
 public:
  // Reads up to `readers` headers at once.
  VersionIndexWriter(Storage& storage, const CheckpointTree& tree, unsigned readers = 16)
      : storage_(storage), tree_(tree), readers_(readers == 0 ? 1 : readers) {}

  // Builds the index of (job, version) from its `world_size` shards and writes it.
  // `registrations[r]` is rank r's current registration: a shard that names another
  // ("ckpt.session") is not this version's, and fails it. Errors: the shard that cannot be
  // read or parsed (naming it), ranks that disagree on a global tensor (VersionIndex::Build),
  // the write's.
  Status Write(const std::string& job, std::uint64_t version, std::uint32_t world_size,
               const std::vector<std::string>& registrations);
  // The index alone, built as Write builds it (for tests and tools).
  Result<VersionIndex> Build(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                             const std::vector<std::string>& registrations);

 private:
  Storage& storage_;
  const CheckpointTree& tree_;
  const unsigned readers_;
};

}  // namespace ckpt
