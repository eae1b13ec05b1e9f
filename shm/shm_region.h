// ShmRegion: a named POSIX shared-memory object the trainer owns and the daemon may read
// (snapshot) and write (restore).
//
// The trainer creates it (mode 0600: only its own user, which the daemon checks), maps it
// and keeps its state there. The daemon never maps it: it reads and writes through the
// descriptor with pread/pwrite, so a region the trainer shrinks or a trainer that dies
// gives the daemon a short read to report, never a SIGBUS, and touched pages do not count
// against the daemon's memory. The name is unlinked when the owning object is destroyed.
//
// The trainer side creates, sizes and maps the object through Boost.Interprocess
// (shared_memory_object, mapped_region), whose exceptions become Status values here. The
// name check and the inode-checked unlink below stay POSIX: the daemon uses them too, and
// only a descriptor of its own (fstat) can tell whether a name still refers to one object.
//
// Not thread-safe for Resize(); data() may be used from any thread.
#pragma once

#include <sys/types.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace ckpt {

class ShmRegion {
 public:
  // Creates (replacing a stale object of the same name) and maps a zero-filled region of
  // `bytes`. `name` must start with '/' and contain no other '/'. Empty `name` picks a
  // unique one. Errors name the region.
  static Result<ShmRegion> Create(std::string name, std::size_t bytes);

  ShmRegion() = default;
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  const std::string& name() const { return name_; }
  void* data() const { return mapping_.get_address(); }
  std::size_t size() const { return mapping_.get_size(); }
  // The object's descriptor (-1 once moved from); it stays owned by this region.
  int fd() const { return object_.get_mapping_handle().handle; }
  // The object's size as the kernel has it now, which differs from size() when a process
  // truncated the object behind this mapping; nullopt if the kernel cannot say.
  std::optional<std::uint64_t> ObjectSize() const;
  // Incremented by every Resize(); a registration records it to detect stale items.
  std::uint64_t generation() const { return generation_; }

  // Changes the size (truncate + remap); grown bytes read as zero. Items registered before
  // become stale. On a failed remap the region is left unmapped (data() null, size() 0).
  Status Resize(std::size_t bytes);

 private:
  // Removes the name if it still refers to this object (not to a newer one of that name).
  void UnlinkIfStillOurs();

  std::string name_;
  boost::interprocess::shared_memory_object object_;
  boost::interprocess::mapped_region mapping_;
  std::uint64_t generation_ = 0;
  ino_t inode_ = 0;
};

// Checks that `name` is an acceptable shm_open name; returns "" or what is wrong.
std::string CheckShmName(const std::string& name);

// Removes shm object `name` only if the name still refers to inode `inode`: a newer object
// created under the same name (a restarted trainer's) is left alone.
void UnlinkShmIfInode(const std::string& name, ino_t inode);

}  // namespace ckpt
