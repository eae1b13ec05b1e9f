// Importers give the daemon access to memory a trainer registered, and copiers move bytes
// between that memory and the host pool.
//
// An ImportedRegion is one region (a POSIX shm object now; a CUDA IPC allocation in the
// GPU backend) opened by the daemon. ReadAt/WriteAt are synchronous copies: for shm they
// are pread/pwrite on the object's descriptor, for CUDA cudaMemcpyAsync on a daemon stream
// then a stream synchronise (restore uses them; snapshots go through the copy lanes of
// backend/device_copier.h, which read CUDA regions asynchronously via DeviceAt). Both report a region that is
// now smaller than asked as an error, never a crash. Thread-safe: several copy threads may read one region at
// once.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace ckpt {

// Device memory a copy lane may read directly: the address, valid while `keep` is held.
struct DeviceSpan {
  void* ptr = nullptr;
  std::shared_ptr<const void> keep;
};

class ImportedRegion {
 public:
  virtual ~ImportedRegion() = default;
  virtual const std::string& name() const = 0;
  // Size of the region now.
  virtual Result<std::uint64_t> CurrentSize() const = 0;
  // Copies `len` bytes at `offset` of the region into `dst` (host memory).
  virtual Status ReadAt(std::uint64_t offset, void* dst, std::size_t len) const = 0;
  // Copies `len` bytes from `src` (host memory) to `offset` of the region.
  virtual Status WriteAt(std::uint64_t offset, const void* src, std::size_t len) const = 0;
  // Removes the region's name if it still names this object (the trainer is gone).
  virtual void UnlinkIfOrphaned() const = 0;
  // A hint before WriteAt calls over `len` bytes at `offset`: back them with memory now, so
  // the writes that follow find their pages allocated (for shm, a trainer's fresh object
  // allocates pages on first write). Changes no byte and never the region's size; a
  // failure is not reported here, the write that follows reports its own.
  virtual void Preallocate(std::uint64_t offset, std::uint64_t len) const {
    (void)offset;
    (void)len;
  }
  // Preallocate, and more: each page is faulted in for writing (a page nothing was written
  // to is filled with zeros, which is what it read as; a written one is left as it is), so
  // the first write of the restore that follows finds memory already in use. It costs more
  // than Preallocate (page tables, zeroing), so it is for time spent waiting anyway: a
  // restart's wait for its newest version. The same guarantees as Preallocate.
  virtual void Prefault(std::uint64_t offset, std::uint64_t len) const { Preallocate(offset, len); }
  // The device the region lives on (an ordinal of the daemon's backend), -1 for host memory.
  virtual int device() const { return -1; }
  // For device regions: the device address of `len` bytes at `offset`, checked against the
  // region's size, for a lane to copy asynchronously.
  virtual Result<DeviceSpan> DeviceAt(std::uint64_t offset, std::size_t len) const {
    (void)offset;
    (void)len;
    return FailedPrecondition("region " + name() + " is host memory");
  }
};

class RegionImporter {
 public:
  virtual ~RegionImporter() = default;
  // Opens region `name` on behalf of a peer with uid `owner`; fails unless the region
  // exists, belongs to `owner` and is at least `min_size` bytes.
  virtual Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, uid_t owner,
                                                         std::uint64_t min_size) = 0;
};

}  // namespace ckpt
