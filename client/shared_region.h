// PosixSharedRegion: ckpt::SharedRegion (ckpt/client.h) on a POSIX shared-memory object
// (shm/shm_region.h), and the removal of the names of the regions still alive when the
// process that created them exits. Private to libckpt.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/client.h"
#include "shm/shm_region.h"

namespace ckpt {

class PosixSharedRegion : public SharedRegion {
 public:
  explicit PosixSharedRegion(ShmRegion r);
  ~PosixSharedRegion() override;
  PosixSharedRegion(const PosixSharedRegion&) = delete;
  PosixSharedRegion& operator=(const PosixSharedRegion&) = delete;
  void* data() const override { return region_.data(); }
  std::size_t size() const override { return region_.size(); }
  const std::string& name() const override { return region_.name(); }
  std::uint64_t generation() const override { return region_.generation(); }
  void resize(std::size_t bytes) override;
  // The size of the shared-memory object now (another process may have shrunk it).
  std::optional<std::uint64_t> object_size() const { return region_.ObjectSize(); }

 private:
  ShmRegion region_;
};

}  // namespace ckpt
