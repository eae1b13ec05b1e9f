#include "common/safe_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace ckpt {
namespace {

constexpr int kSafeFlags = O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;

std::string NotA(const std::string& path, mode_t mode, const char* wanted) {
  return path + " is " + FileTypeName(mode) + ", not " + wanted;
}

// The type of what is at `path` (not following a link), or 0 when nothing can be stat-ed.
mode_t TypeAt(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

// fstat of a freshly opened descriptor: the entry may have changed since the lstat.
Status CheckOpened(int fd, const std::string& path, bool want_dir, Status (*refuse)(std::string)) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("stat " + path, errno);
  if (want_dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) {
    return refuse(NotA(path, st.st_mode, want_dir ? "a directory" : "a regular file"));
  }
  return Status::Ok();
}

// O_NONBLOCK only mattered for the open; a regular file reads and writes as usual without it.
Status ClearNonBlock(int fd, const std::string& path) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) return IoError("fcntl " + path, errno);
  return Status::Ok();
}

}  // namespace

std::string FileTypeName(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFLNK:
      return "a symbolic link";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    default:
      return "a file of unknown type";
  }
}

Result<UniqueFd> OpenRegularForRead(const std::string& path, int extra_flags) {
  if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {
    return DataLoss(NotA(path, type, "a regular file"));
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | kSafeFlags | extra_flags));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT) return NotFound(path + " does not exist");
    if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {  // swapped in after the lstat
      return DataLoss(NotA(path, type, "a regular file"));
    }
    errno = err;
    return IoError("open " + path, err);
  }
  if (Status s = CheckOpened(fd.get(), path, false, DataLoss); !s.ok()) return s;
  if (Status s = ClearNonBlock(fd.get(), path); !s.ok()) return s;
  return fd;
}

Result<UniqueFd> CreateRegularFile(const std::string& path, int extra_flags, mode_t mode) {
  // O_EXCL first: it creates the file or fails on anything there, a dangling link included,
  // without opening it. Only an existing regular file is then opened again, to truncate it.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | kSafeFlags | extra_flags, mode));
  if (!fd.valid() && errno == EEXIST) {
    if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {
      return FailedPrecondition(NotA(path, type, "a regular file") + ": not written through it");
    }
    fd.reset(::open(path.c_str(), O_WRONLY | O_TRUNC | kSafeFlags | extra_flags));
  }
  if (!fd.valid()) {
    const int err = errno;
    if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {
      return FailedPrecondition(NotA(path, type, "a regular file") + ": not written through it");
    }
    return IoError("create " + path, err);
  }
  if (Status s = CheckOpened(fd.get(), path, false, FailedPrecondition); !s.ok()) return s;
  if (Status s = ClearNonBlock(fd.get(), path); !s.ok()) return s;
  return fd;
}

Result<UniqueFd> OpenDirectory(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | kSafeFlags));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT) return NotFound(path + " does not exist");
    if (mode_t type = TypeAt(path); type != 0 && type != S_IFDIR) {
      return FailedPrecondition(NotA(path, type, "a directory"));
    }
    return IoError("open directory " + path, err);
  }
  if (Status s = CheckOpened(fd.get(), path, true, FailedPrecondition); !s.ok()) return s;
  return fd;
}

}  // namespace ckpt
