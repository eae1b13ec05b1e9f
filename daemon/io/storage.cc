#include "daemon/io/storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "format/paths.h"

namespace ckpt {

Status Storage::WriteFileAtomic(const std::string& path, const std::string& content) {
  std::string tmp = path + TmpSuffix();
  auto fd = CreateFile(tmp, /*direct=*/false);
  if (!fd.ok()) return fd.status();
  // A failed step leaves no temporary file behind (not even until the next restart).
  auto failed = [&](Status s) {
    fd->reset();
    Remove(tmp);
    return s;
  };
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
  int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) return IoError("create " + path, errno);
  return UniqueFd(fd);
}

Result<UniqueFd> PosixStorage::OpenForRead(const std::string& path, bool direct) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  if (fd < 0) {
    if (errno == ENOENT) return NotFound(path + " does not exist");
    return IoError("open " + path, errno);
  }
  return UniqueFd(fd);
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
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("open directory " + dir, errno);
  UniqueFd owned(fd);
  if (::fsync(fd) != 0) return IoError("fsync directory " + dir, errno);
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

Status PosixStorage::Remove(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    if (errno == EISDIR && ::rmdir(path.c_str()) == 0) return Status::Ok();
    return IoError("remove " + path, errno);
  }
  return Status::Ok();
}

Result<std::vector<std::string>> PosixStorage::List(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return NotFound(dir + " does not exist");
    return IoError("list " + dir, errno);
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  return names;
}

bool PosixStorage::Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

bool PosixStorage::SupportsDirectIo(const std::string& dir) {
  std::string probe = JoinPath(dir, ".ckptd-direct-io-probe.tmp");
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  void* buf = nullptr;
  bool ok = ::posix_memalign(&buf, 4096, 4096) == 0;
  if (ok) {
    std::fill_n(static_cast<char*>(buf), 4096, 0);
    ok = ::pwrite(fd, buf, 4096, 0) == 4096;
    std::free(buf);
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return ok;
}

}  // namespace ckpt
