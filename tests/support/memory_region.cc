#include "support/memory_region.h"

#include <cerrno>
#include <cstring>

namespace ckpt::test {

Status MemoryRegion::ReadAt(std::uint64_t offset, void* dst, std::size_t len) const {
  reads_.fetch_add(1);
  if (offset + len > fail_from_.load()) return IoError("read region " + name_, EFAULT);
  if (offset + len > bytes_.size()) return FailedPrecondition("region " + name_ + " is too small");
  std::memcpy(dst, bytes_.data() + offset, len);
  return Status::Ok();
}

Status WritableRegion::WriteAt(std::uint64_t offset, const void* src, std::size_t len) const {
  writes_.fetch_add(1);
  if (offset + len > bytes().size()) return FailedPrecondition("region " + name() + " is too small");
  std::memcpy(const_cast<char*>(bytes().data()) + offset, src, len);
  return Status::Ok();
}

}  // namespace ckpt::test
