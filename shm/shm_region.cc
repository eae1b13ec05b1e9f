#include "shm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/permissions.hpp>
#include <utility>

#include "common/names.h"

namespace ckpt {
namespace {

namespace bip = boost::interprocess;

// Boost reports failures as exceptions; callers of this file get Status values. A system
// failure carries its errno, which IoError spells out; a library one (Boost refusing an
// argument) has only Boost's own text.
Status FromBoost(const std::string& what, const bip::interprocess_exception& e) {
  if (e.get_native_error() != 0) return IoError(what, e.get_native_error());
  return Internal(what + ": " + e.what());
}

}  // namespace

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
  // A region of the same name left by a crashed trainer is replaced, never reused: the
  // create below is exclusive, so an object that reappears in between fails it.
  bip::shared_memory_object::remove(name.c_str());
  ShmRegion region;
  try {
    // Boost sets the mode with fchmod after the exclusive create, so it is 0600 whatever
    // the umask.
    region.object_ =
        bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, bip::permissions(0600));
  } catch (const bip::interprocess_exception& e) {
    return FromBoost("shm_open " + name, e);
  }
  region.name_ = std::move(name);
  // Boost has no identity query: the inode, which UnlinkIfStillOurs compares, comes from
  // the descriptor it exposes.
  struct stat st {};
  if (::fstat(region.fd(), &st) == 0) region.inode_ = st.st_ino;
  // Boost opens without O_CLOEXEC; set it at once, so a program the trainer starts does not
  // inherit the descriptor and keep the object's memory alive. (Only an exec by another
  // thread between the open and this call could still inherit it.)
  if (::fcntl(region.fd(), F_SETFD, FD_CLOEXEC) != 0) {
    return IoError("set close-on-exec on shm " + region.name_, errno);
  }
  if (Status s = region.Resize(bytes); !s.ok()) return s;
  region.generation_ = 0;
  return region;
}

ShmRegion::ShmRegion(ShmRegion&& other) noexcept { *this = std::move(other); }

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    UnlinkIfStillOurs();
    name_ = std::exchange(other.name_, {});
    // Boost's moves leave `other` without a mapping or descriptor and drop ours.
    mapping_ = std::move(other.mapping_);
    object_ = std::move(other.object_);
    generation_ = other.generation_;
    inode_ = other.inode_;
  }
  return *this;
}

ShmRegion::~ShmRegion() { UnlinkIfStillOurs(); }

// POSIX, not Boost: the daemon calls this too, and Boost's remove() would unlink whatever
// object holds the name now; only a descriptor of its own and fstat tell which one it is.
void UnlinkShmIfInode(const std::string& name, ino_t inode) {
  // Never blocks (a FIFO put in the object's place would, opened for reading) and never
  // follows a link: whatever holds the name now is only looked at.
  int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
  if (fd < 0) return;
  struct stat st {};
  bool same = ::fstat(fd, &st) == 0 && st.st_ino == inode;
  ::close(fd);
  if (same) ::shm_unlink(name.c_str());
}

void ShmRegion::UnlinkIfStillOurs() {
  if (!name_.empty() && fd() >= 0) UnlinkShmIfInode(name_, inode_);
}

std::optional<std::uint64_t> ShmRegion::ObjectSize() const {
  bip::offset_t bytes = 0;
  if (!object_.get_size(bytes)) return std::nullopt;
  return static_cast<std::uint64_t>(bytes);
}

Status ShmRegion::Resize(std::size_t bytes) {
  // Checked here, not left to Boost: a mapped_region of size 0 means "the whole object",
  // and the object would already have been truncated to nothing.
  if (bytes == 0) return InvalidArgument("shm region " + name_ + " must not be empty");
  try {
    object_.truncate(static_cast<bip::offset_t>(bytes));
  } catch (const bip::interprocess_exception& e) {
    return FromBoost("ftruncate shm " + name_ + " to " + std::to_string(bytes) + " bytes", e);
  }
  // The old mapping goes before the new one is made: past a shrunk object's end it would
  // fault, so it must not outlive a failed remap either.
  mapping_ = bip::mapped_region();
  try {
    mapping_ = bip::mapped_region(object_, bip::read_write, 0, bytes);
  } catch (const bip::interprocess_exception& e) {
    return FromBoost("mmap shm " + name_, e);
  }
  ++generation_;
  return Status::Ok();
}

}  // namespace ckpt
