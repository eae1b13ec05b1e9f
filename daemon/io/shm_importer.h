// ShmImporter: opens the POSIX shared-memory objects a trainer registered (its regions and
// its descriptor table) for the daemon. Every object is opened without following links,
// checked to be a regular file owned by the registering uid, and its inode
// remembered so that a later unlink removes only that object, never a new one of the same
// name. Reads and writes are pread/pwrite on the descriptor: no mapping is kept, so a
// trainer that shrinks its region makes the next access fail with an error, not a SIGBUS.
// Thread-safe.
#pragma once

#include "backend/region_importer.h"

namespace ckpt {

// Importer of POSIX shared-memory objects.
class ShmImporter : public RegionImporter {
 public:
  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, uid_t owner,
                                                 std::uint64_t min_size) override;
};

}  // namespace ckpt
