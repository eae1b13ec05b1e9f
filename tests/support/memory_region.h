// MemoryRegion: trainer memory held by the test as plain bytes, imported as the daemon
// imports an shm region, so the engines can copy out of it without shared memory. Reads
// can be made to fail from some offset on (a region the trainer shrank or unmapped) and
// are counted. Writes are refused: the snapshot engines only read regions. WritableRegion
// is one a restore may write.
//
// Thread-safety: ReadAt, FailReadsFrom and reads() may be called from any thread (several
// copy threads read one region at once). The bytes are fixed at construction; subclasses
// that change them (support/fake_device.h) say when that may happen.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "backend/region_importer.h"

namespace ckpt::test {

class MemoryRegion : public ImportedRegion {
 public:
  MemoryRegion(std::string name, std::string bytes) : name_(std::move(name)), bytes_(std::move(bytes)) {}

  const std::string& name() const override { return name_; }
  Result<std::uint64_t> CurrentSize() const override { return static_cast<std::uint64_t>(bytes_.size()); }
  // Fails with EFAULT once the read reaches the offset given to FailReadsFrom.
  Status ReadAt(std::uint64_t offset, void* dst, std::size_t len) const override;
  Status WriteAt(std::uint64_t, const void*, std::size_t) const override {
    return Internal("the engines under test never write to a region");
  }
  void UnlinkIfOrphaned() const override {}

  const std::string& bytes() const { return bytes_; }
  void FailReadsFrom(std::uint64_t offset) { fail_from_.store(offset); }
  // ReadAt calls so far, failed ones included.
  int reads() const { return reads_.load(); }

 private:
  std::string name_;
  std::string bytes_;
  std::atomic<std::uint64_t> fail_from_{UINT64_MAX};
  mutable std::atomic<int> reads_{0};
};

// Trainer memory a restore writes into (for shm: pwrite). Writes land in bytes() and are
// counted; they must not run while the test reads bytes().
class WritableRegion : public MemoryRegion {
 public:
  using MemoryRegion::MemoryRegion;
  Status WriteAt(std::uint64_t offset, const void* src, std::size_t len) const override;
  // WriteAt calls so far.
  int writes() const { return writes_.load(); }

 private:
  mutable std::atomic<int> writes_{0};
};

}  // namespace ckpt::test
