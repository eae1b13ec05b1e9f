#include "shm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <utility>

#include "common/names.h"

namespace ckpt {

std::string CheckShmName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/') return "shm name " + QuoteName(name) + " must start with '/'";
  if (name.size() > 200) return "shm name " + QuoteName(name) + " is longer than 200 characters";
  if (name.find('/', 1) != std::string::npos) {
    return "shm name " + QuoteName(name) + " contains a second '/'";
  }
  for (char c : name) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x21 || u >= 0x7f) return "shm name " + QuoteName(name) + " has an unprintable character";
  }
  if (name == "/." || name == "/..") return "shm name " + QuoteName(name) + " is not a name";
  return {};
}

Result<ShmRegion> ShmRegion::Create(std::string name, std::size_t bytes) {
  static std::atomic<std::uint64_t> serial{0};
  if (name.empty()) {
    name = "/ckpt-" + std::to_string(::getuid()) + "-" + std::to_string(::getpid()) + "-" +
           std::to_string(serial.fetch_add(1));
  }
  if (std::string err = CheckShmName(name); !err.empty()) return InvalidArgument(err);
  if (bytes == 0) return InvalidArgument("shm region " + name + " must not be empty");
  // A region of the same name left by a crashed trainer is replaced, never reused.
  ::shm_unlink(name.c_str());
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return IoError("shm_open " + name, errno);
  ShmRegion region;
  region.name_ = std::move(name);
  region.fd_.reset(fd);
  struct stat st {};
  if (::fstat(fd, &st) == 0) region.inode_ = st.st_ino;
  if (Status s = region.Resize(bytes); !s.ok()) return s;
  region.generation_ = 0;
  return region;
}

ShmRegion::ShmRegion(ShmRegion&& other) noexcept { *this = std::move(other); }

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    Unmap();
    UnlinkIfStillOurs();
    name_ = std::exchange(other.name_, {});
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    generation_ = other.generation_;
    inode_ = other.inode_;
  }
  return *this;
}

ShmRegion::~ShmRegion() {
  Unmap();
  UnlinkIfStillOurs();
}

void UnlinkShmIfInode(const std::string& name, ino_t inode) {
  int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return;
  struct stat st {};
  bool same = ::fstat(fd, &st) == 0 && st.st_ino == inode;
  ::close(fd);
  if (same) ::shm_unlink(name.c_str());
}

void ShmRegion::UnlinkIfStillOurs() {
  if (!name_.empty() && fd_.valid()) UnlinkShmIfInode(name_, inode_);
}

void ShmRegion::Unmap() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
}

Status ShmRegion::Resize(std::size_t bytes) {
  if (::ftruncate(fd_.get(), static_cast<off_t>(bytes)) != 0) {
    return IoError("ftruncate shm " + name_ + " to " + std::to_string(bytes) + " bytes", errno);
  }
  Unmap();
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
  if (p == MAP_FAILED) return IoError("mmap shm " + name_, errno);
  data_ = p;
  size_ = bytes;
  ++generation_;
  return Status::Ok();
}

}  // namespace ckpt
