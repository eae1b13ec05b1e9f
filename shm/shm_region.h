// ShmRegion: a named POSIX shared-memory object the trainer owns and the daemon may read
// (snapshot) and write (restore).
//
// The trainer creates it (mode 0600: only its own user, which the daemon checks), maps it
// and keeps its state there. The daemon never maps it: it reads and writes through the
// descriptor with pread/pwrite, so a region the trainer shrinks or a trainer that dies
// gives the daemon a short read to report, never a SIGBUS, and touched pages do not count
// against the daemon's memory. The name is unlinked when the owning object is destroyed.
//
// Not thread-safe for Resize(); data() may be used from any thread.
#pragma once

#include <cstddef>
#include <sys/types.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

class ShmRegion {
 public:
  // Creates (replacing a stale object of the same name) and maps a region of `bytes`.
  // `name` must start with '/' and contain no other '/'. Empty `name` picks a unique one.
  static Result<ShmRegion> Create(std::string name, std::size_t bytes);

  ShmRegion() = default;
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  // Incremented by every Resize(); a registration records it to detect stale items.
  std::uint64_t generation() const { return generation_; }

  // Changes the size (ftruncate + remap). Items registered before become stale.
  Status Resize(std::size_t bytes);

 private:
  void Unmap();
  // Removes the name if it still refers to this object (not to a newer one of that name).
  void UnlinkIfStillOurs();

  std::string name_;
  UniqueFd fd_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint64_t generation_ = 0;
  ino_t inode_ = 0;
};

// Checks that `name` is an acceptable shm_open name; returns "" or what is wrong.
std::string CheckShmName(const std::string& name);

// Removes shm object `name` only if the name still refers to inode `inode`: a newer object
// created under the same name (a restarted trainer's) is left alone.
void UnlinkShmIfInode(const std::string& name, ino_t inode);

}  // namespace ckpt
