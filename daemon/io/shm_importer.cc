#include "daemon/io/shm_importer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/unique_fd.h"
#include "shm/shm_region.h"

namespace ckpt {
namespace {

class ShmImportedRegion : public ImportedRegion {
 public:
  ShmImportedRegion(std::string name, UniqueFd fd, ino_t ino)
      : name_(std::move(name)), fd_(std::move(fd)), ino_(ino) {}

  const std::string& name() const override { return name_; }

  Result<std::uint64_t> CurrentSize() const override {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) return IoError("stat shm " + name_, errno);
    return static_cast<std::uint64_t>(st.st_size);
  }

  Status ReadAt(std::uint64_t offset, void* dst, std::size_t len) const override {
    char* p = static_cast<char*>(dst);
    std::size_t done = 0;
    while (done < len) {
      ssize_t r = ::pread(fd_.get(), p + done, len - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return IoError("read shm region " + name_, errno);
      if (r == 0) {
        return FailedPrecondition("shm region " + name_ + " shrank below offset " +
                                  std::to_string(offset + done) + " while it was being copied");
      }
      done += static_cast<std::size_t>(r);
    }
    return Status::Ok();
  }

  Status WriteAt(std::uint64_t offset, const void* src, std::size_t len) const override {
    auto size = CurrentSize();
    if (!size.ok()) return size.status();
    if (offset + len > size.value()) {
      return FailedPrecondition("shm region " + name_ + " is smaller than the item restored into it");
    }
    const char* p = static_cast<const char*>(src);
    std::size_t done = 0;
    while (done < len) {
      ssize_t w = ::pwrite(fd_.get(), p + done, len - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return IoError("write shm region " + name_, w < 0 ? errno : EIO);
      done += static_cast<std::size_t>(w);
    }
    return Status::Ok();
  }

  void UnlinkIfOrphaned() const override { UnlinkShmIfInode(name_, ino_); }

  // fallocate allocates tmpfs pages without zeroing them (they read as zero until written)
  // and, unlike a fault or MADV_POPULATE_WRITE, without mapping them: the pwrite calls of a
  // restore then only copy. KEEP_SIZE and the clamp keep it inside the object as it is now.
  void Preallocate(std::uint64_t offset, std::uint64_t len) const override {
    auto size = CurrentSize();
    if (!size.ok() || offset >= size.value()) return;
    len = std::min(len, size.value() - offset);
    if (len > 0) {
      (void)::fallocate(fd_.get(), FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(len));
    }
  }

  // MADV_POPULATE_WRITE (Linux 5.14) on a mapping of its own: the kernel write-faults each
  // page as a store would, without storing. Where a page is new it is zeroed, and the
  // memory behind it really touched: in a virtual machine whose host takes freed guest
  // memory back (free page reporting), that first touch costs about 9 us a page, paid here
  // rather than in the copy. Kernels without it get Preallocate.
  void Prefault(std::uint64_t offset, std::uint64_t len) const override {
    auto size = CurrentSize();
    if (!size.ok() || offset >= size.value()) return;
    const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t begin = offset / page * page;
    const std::uint64_t end = std::min(size.value(), offset + std::min(len, size.value() - offset));
    const std::uint64_t bytes = (end - begin + page - 1) / page * page;
    if (bytes == 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), static_cast<off_t>(begin));
    if (p == MAP_FAILED) {
      Preallocate(offset, len);
      return;
    }
    // Past the object's end (it shrank meanwhile) the call fails with EFAULT: then nothing
    // more is done, and the restore's writes report the size.
    if (::madvise(p, bytes, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) Preallocate(offset, len);
    ::munmap(p, bytes);
  }

 private:
  std::string name_;
  UniqueFd fd_;
  ino_t ino_;
};

// Opens `name` without following links and checks it is a regular object of `owner` of at
// least `min_size` bytes; *st gets its attributes.
Result<UniqueFd> OpenChecked(const std::string& name, uid_t owner, std::uint64_t min_size,
                             struct stat* st_out) {
  if (std::string err = CheckShmName(name); !err.empty()) return InvalidArgument(err);
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound("shm region " + name + " does not exist");
    if (errno == ELOOP || errno == EISDIR || errno == EINVAL || errno == ENXIO || errno == ENODEV) {
      return InvalidArgument("shm region " + name + " is not a shared-memory object (a symbolic link, " +
                             "directory or device has its name)");
    }
    return IoError("open shm region " + name, errno);
  }
  UniqueFd owned(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("stat shm region " + name, errno);
  if (!S_ISREG(st.st_mode)) return InvalidArgument("shm region " + name + " is not a regular object");
  if (st.st_uid != owner) {
    return PermissionDenied("shm region " + name + " belongs to uid " + std::to_string(st.st_uid) +
                            ", not to the registering trainer's uid " + std::to_string(owner));
  }
  if (static_cast<std::uint64_t>(st.st_size) < min_size) {
    return InvalidArgument("shm region " + name + " is " + std::to_string(st.st_size) +
                           " bytes, smaller than the " + std::to_string(min_size) + " its items need");
  }
  *st_out = st;
  return owned;
}

}  // namespace

Result<std::shared_ptr<ImportedRegion>> ShmImporter::Import(const std::string& name, uid_t owner,
                                                            std::uint64_t min_size) {
  struct stat st {};
  auto fd = OpenChecked(name, owner, min_size, &st);
  if (!fd.ok()) return fd.status();
  return std::shared_ptr<ImportedRegion>(
      std::make_shared<ShmImportedRegion>(name, std::move(fd).value(), st.st_ino));
}

Result<std::shared_ptr<ShmMapping>> MapShmObject(const std::string& name, uid_t owner, std::size_t bytes) {
  struct stat st {};
  auto fd = OpenChecked(name, owner, bytes, &st);
  if (!fd.ok()) return fd.status();
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.value().get(), 0);
  if (p == MAP_FAILED) return IoError("map shm object " + name, errno);
  return std::make_shared<ShmMapping>(p, bytes);
}

ShmMapping::~ShmMapping() { ::munmap(data_, size_); }

}  // namespace ckpt
