// ShmImporter: opens the POSIX shared-memory objects a trainer registered (its regions and
// its descriptor table) for the daemon. Every object is opened without following links,
// checked to be a regular file owned by the registering uid, and its inode
// remembered so that a later unlink removes only that object, never a new one of the same
// name. Reads and writes are pread/pwrite on the descriptor: no mapping is kept, so a
// trainer that shrinks its region makes the next access fail with an error, not a SIGBUS.
// Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "backend/region_importer.h"

namespace ckpt {

// Importer of POSIX shared-memory objects.
class ShmImporter : public RegionImporter {
 public:
  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, uid_t owner,
                                                 std::uint64_t min_size) override;
};

// A shared mapping of a trainer's shm object that the daemon keeps: the trainer's release
// words (client/release_words.h), which only the daemon's GPU streams write. Opened with
// Import's checks (no links followed, a regular object of `owner`, at least `bytes`). The
// daemon's CPU never reads or writes it, so a trainer that shrinks the object cannot make
// the daemon fault (the device writes go to page-locked pages). Unmapped on destruction.
class ShmMapping {
 public:
  ShmMapping(void* data, std::size_t size) : data_(data), size_(size) {}
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  void* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void* data_;
  std::size_t size_;
};

Result<std::shared_ptr<ShmMapping>> MapShmObject(const std::string& name, uid_t owner, std::size_t bytes);

}  // namespace ckpt
