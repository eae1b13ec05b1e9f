#include "common/safe_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <random>

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

Status CheckOwnRegularFile(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("stat " + path, errno);
  if (!S_ISREG(st.st_mode)) {
    return FailedPrecondition(NotA(path, st.st_mode, "a regular file") + ": not written through it");
  }
  if (st.st_uid != ::geteuid()) {
    return FailedPrecondition(path + " is owned by uid " + std::to_string(st.st_uid) +
                              ", not by this process's uid " + std::to_string(::geteuid()) +
                              ": not written through it");
  }
  if (st.st_nlink != 1) {
    return FailedPrecondition(path + " has " + std::to_string(st.st_nlink) +
                              " links (a hard link to another file?): not written through it");
  }
  return Status::Ok();
}

Result<UniqueFd> CreateNewRegularFile(const std::string& path, int extra_flags, mode_t mode) {
  // O_CREAT | O_EXCL fails on anything at the path, a dangling link included, without
  // opening or following it.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | kSafeFlags | extra_flags, mode));
  if (!fd.valid()) {
    const int err = errno;
    if (err == EEXIST) {
      const mode_t type = TypeAt(path);
      return AlreadyExists(path + " exists" + (type != 0 ? " (" + FileTypeName(type) + ")" : std::string()) +
                           ": not opened");
    }
    errno = err;
    return IoError("create " + path, err);
  }
  if (Status s = CheckOpened(fd.get(), path, false, FailedPrecondition); !s.ok()) return s;
  if (Status s = ClearNonBlock(fd.get(), path); !s.ok()) return s;
  return fd;
}

Result<UniqueFd> OpenRegularForWrite(const std::string& path, ExistingFile existing, int extra_flags,
                                     mode_t mode) {
  if (existing == ExistingFile::kAppend) extra_flags |= O_APPEND;
  auto created = CreateNewRegularFile(path, extra_flags, mode);
  if (created.ok() || created.status().code() != StatusCode::kAlreadyExists) return created;
  // Something is there. Only a regular file is opened, and without O_TRUNC: it is emptied
  // only once it is known to be ours.
  if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {
    return FailedPrecondition(NotA(path, type, "a regular file") + ": not written through it");
  }
  UniqueFd fd(::open(path.c_str(), O_WRONLY | kSafeFlags | extra_flags));
  if (!fd.valid()) {
    const int err = errno;
    if (mode_t type = TypeAt(path); type != 0 && type != S_IFREG) {  // swapped in after the lstat
      return FailedPrecondition(NotA(path, type, "a regular file") + ": not written through it");
    }
    errno = err;
    return IoError("open " + path, err);
  }
  if (Status s = CheckOwnRegularFile(fd.get(), path); !s.ok()) return s;
  if (Status s = ClearNonBlock(fd.get(), path); !s.ok()) return s;
  if (existing == ExistingFile::kTruncate && ::ftruncate(fd.get(), 0) != 0)
    return IoError("truncate " + path, errno);
  return fd;
}

Result<UniqueFd> CreateRegularFile(const std::string& path, int extra_flags, mode_t mode) {
  return OpenRegularForWrite(path, ExistingFile::kTruncate, extra_flags, mode);
}

std::string RandomHex() {
  std::uint64_t bits = 0;
  for (std::size_t got = 0; got < sizeof bits;) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(&bits) + got, sizeof bits - got, 0);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (errno != EINTR) {
      // No kernel source (a seccomp filter?): the library's, which reads it too.
      std::random_device rd;
      bits = (std::uint64_t{rd()} << 32) ^ rd();
      break;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(bits));
  return buf;
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
