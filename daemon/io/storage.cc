#include "daemon/io/storage.h"
#include "common/strings.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/safe_file.h"
#include "format/paths.h"

namespace ckpt {

Status Storage::WriteFileAtomic(const std::string& path, const std::string& content, mode_t mode) {
  // A name no one can guess: in a directory others can write, nothing can be planted at it
  // beforehand (and CreateFile opens nothing that is there).
  std::string tmp = path + "." + RandomHex() + TmpSuffix();
  auto fd = CreateFile(tmp, /*direct=*/false);
  if (!fd.ok()) return fd.status();
  // A failed step leaves no temporary file behind (not even until the next restart).
  auto failed = [&](Status s) {
    fd->reset();
    Remove(tmp);
    return s;
  };
  if (mode != 0600 && ::fchmod(fd->get(), mode) != 0) return failed(IoError("chmod " + tmp, errno));
  if (Status s = WriteAt(fd->get(), content.data(), content.size(), 0, tmp); !s.ok()) return failed(s);
  if (Status s = DataSync(fd->get(), tmp); !s.ok()) return failed(s);
  fd->reset();
  if (Status s = Rename(tmp, path); !s.ok()) return failed(s);
  std::string dir = path.substr(0, path.find_last_of('/'));
  return SyncDir(dir.empty() ? "/" : dir);
}

Result<std::string> Storage::ReadSmallFile(const std::string& path) {
  auto fd = OpenForRead(path, false);
  if (!fd.ok()) return fd.status();
  std::string out;
  char buf[4096];
  for (;;) {
    auto n = ReadAt(fd->get(), buf, sizeof buf, out.size(), path);
    if (!n.ok()) return n.status();
    if (n.value() == 0) break;
    out.append(buf, n.value());
    if (out.size() > (1 << 20)) return DataLoss(path + " is larger than expected");
  }
  return out;
}

Result<UniqueFd> PosixStorage::CreateFile(const std::string& path, bool direct) {
  const int flags = direct ? O_DIRECT : 0;
  if (!EndsWith(path, TmpSuffix())) return CreateRegularFile(path, flags, 0600);
  // This daemon's temporary file is always created new. Whatever is at its name (a FIFO, a
  // link, a file someone planted to have the daemon write through it and rename it into
  // place) is no one's data, a restart removes it too: the entry itself is removed, never
  // what a link points to, and the file is created anew, so that one planted entry fails no
  // write. Planted again in between, it is an error: the daemon writes through nothing.
  auto fd = CreateNewRegularFile(path, flags, 0600);
  if (fd.ok() || fd.status().code() != StatusCode::kAlreadyExists) return fd;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return IoError("remove " + path, errno);
  fd = CreateNewRegularFile(path, flags, 0600);
  if (!fd.ok() && fd.status().code() == StatusCode::kAlreadyExists) {
    return FailedPrecondition(fd.status().message() + " again after its removal");
  }
  return fd;
}

Result<UniqueFd> PosixStorage::OpenForRead(const std::string& path, bool direct) {
  return OpenRegularForRead(path, direct ? O_DIRECT : 0);
}

Status PosixStorage::WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                             const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  std::size_t done = 0;
  while (done < len) {
    ssize_t w = ::pwrite(fd, p + done, len - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return IoError("write " + what + " at offset " + std::to_string(offset + done), errno);
    if (w == 0) return IoError("write " + what + " made no progress", EIO);
    done += static_cast<std::size_t>(w);
  }
  return Status::Ok();
}

Result<std::size_t> PosixStorage::ReadAt(int fd, void* buf, std::size_t len, std::uint64_t offset,
                                         const std::string& what) {
  char* p = static_cast<char*>(buf);
  std::size_t done = 0;
  while (done < len) {
    ssize_t r = ::pread(fd, p + done, len - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return IoError("read " + what + " at offset " + std::to_string(offset + done), errno);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

Status PosixStorage::Truncate(int fd, std::uint64_t size, const std::string& what) {
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return IoError("truncate " + what, errno);
  return Status::Ok();
}

Status PosixStorage::DataSync(int fd, const std::string& what) {
  if (::fdatasync(fd) != 0) return IoError("fdatasync " + what, errno);
  return Status::Ok();
}

Status PosixStorage::Rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) return IoError("rename " + from + " to " + to, errno);
  return Status::Ok();
}

Status PosixStorage::Link(const std::string& from, const std::string& to) {
  if (::link(from.c_str(), to.c_str()) != 0) {
    if (errno == EEXIST) return AlreadyExists(to + " exists");
    return IoError("link " + from + " to " + to, errno);
  }
  return Status::Ok();
}

Status PosixStorage::SyncDir(const std::string& dir) {
  auto fd = OpenDirectory(dir);
  if (!fd.ok()) return fd.status();
  if (::fsync(fd->get()) != 0) return IoError("fsync directory " + dir, errno);
  return Status::Ok();
}

Status PosixStorage::MakeDirs(const std::string& dir) {
  std::string path;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (path.empty()) continue;
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return IoError("mkdir " + path, errno);
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return FailedPrecondition(dir + " exists but is not a directory");
  }
  return Status::Ok();
}

Status PosixStorage::SetOwner(const std::string& path, uid_t uid, gid_t gid) {
  if (::fchownat(AT_FDCWD, path.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == EPERM) {
      return PermissionDenied("chown " + path + " to uid " + std::to_string(uid) + ": " +
                              std::strerror(errno));
    }
    return IoError("chown " + path + " to uid " + std::to_string(uid) + " gid " + std::to_string(gid), errno);
  }
  return Status::Ok();
}

Status PosixStorage::Remove(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    if (errno == EISDIR && ::rmdir(path.c_str()) == 0) return Status::Ok();
    return IoError("remove " + path, errno);
  }
  return Status::Ok();
}

Result<std::vector<std::string>> PosixStorage::List(const std::string& dir) {
  auto fd = OpenDirectory(dir);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<DIR, int (*)(DIR*)> d(::fdopendir(fd->get()), ::closedir);
  if (d == nullptr) return IoError("list " + dir, errno);
  fd->release();  // closedir closes it
  std::vector<std::string> names;
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d.get());
    if (e == nullptr) break;
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  // A failed readdir is not the end of the listing: a caller deciding what to delete must know.
  if (errno != 0) return IoError("list " + dir, errno);
  return names;
}

bool PosixStorage::Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

Result<std::uint64_t> PosixStorage::FileSize(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return IoError("stat " + path, errno);
  return static_cast<std::uint64_t>(st.st_size);
}

bool PosixStorage::SupportsDirectIo(const std::string& dir) {
  // Named as this daemon's temporary files are, so that daemons of other nodes probing the
  // same shared directory do not share (and remove) one probe file.
  std::string probe = JoinPath(dir, ".ckptd-direct-io-probe" + TmpSuffix());
  auto fd = CreateFile(probe, /*direct=*/true);
  if (!fd.ok()) return false;
  void* buf = nullptr;
  bool ok = ::posix_memalign(&buf, 4096, 4096) == 0;
  if (ok) {
    std::fill_n(static_cast<char*>(buf), 4096, 0);
    ok = ::pwrite(fd->get(), buf, 4096, 0) == 4096;
    std::free(buf);
  }
  fd->reset();
  ::unlink(probe.c_str());
  return ok;
}

}  // namespace ckpt
