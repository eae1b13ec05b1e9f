// Storage: every file-system call the daemon's engines make, behind one interface.
//
// PosixStorage is the real thing. StorageWrapper forwards every call to another Storage,
// so a test overrides only the call it wants to break (ENOSPC on the third write, EIO on
// fdatasync, a short write) without a mocking framework. Implementations are thread-safe.
// Every method returns a Status naming the path and the operating-system error.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

class Storage {
 public:
  virtual ~Storage() = default;

  // Opens `path` for writing, creating or truncating it (mode 0600). With `direct`, the
  // file is opened with O_DIRECT: buffers, offsets and lengths must be 4 KiB aligned.
  // Nothing is written through a symbolic link, FIFO, device or a file that is not this
  // process's own at `path` (common/safe_file.h): a temporary path of this daemon
  // (TmpSuffix()) is always created new (O_EXCL), whatever was there removed first;
  // anywhere else such a thing is FailedPrecondition.
  virtual Result<UniqueFd> CreateFile(const std::string& path, bool direct) = 0;
  // Opens the regular file `path` for reading, with O_DIRECT if `direct`. A FIFO, device,
  // directory or symbolic link there is DataLoss naming it, without blocking or following.
  virtual Result<UniqueFd> OpenForRead(const std::string& path, bool direct) = 0;
  // Writes all `len` bytes at `offset` (retrying short writes); `what` names the file.
  virtual Status WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                         const std::string& what) = 0;
  // Reads up to `len` bytes at `offset`; returns the count (short only at end of file).
  virtual Result<std::size_t> ReadAt(int fd, void* buf, std::size_t len, std::uint64_t offset,
                                     const std::string& what) = 0;
  virtual Status Truncate(int fd, std::uint64_t size, const std::string& what) = 0;
  virtual Status DataSync(int fd, const std::string& what) = 0;
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Hard link `to` to `from`, never replacing `to`: AlreadyExists if it exists. The one
  // create-once step that works across nodes, parallel file systems included (job owners).
  virtual Status Link(const std::string& from, const std::string& to) = 0;
  // fsync of a directory, making renames and creations in it durable. Here and in List,
  // `dir` must be a directory, not a symbolic link to one (FailedPrecondition).
  virtual Status SyncDir(const std::string& dir) = 0;
  // mkdir -p, mode 0700 for created directories. Existing ones are left as they are.
  virtual Status MakeDirs(const std::string& dir) = 0;
  // chown of `path` itself (a symbolic link there is not followed). Only for directories
  // the daemon has just created (a job's, for its owner): never an existing one.
  virtual Status SetOwner(const std::string& path, uid_t uid, gid_t gid) = 0;
  virtual Status Remove(const std::string& path) = 0;
  // Names in `dir` (without . and ..); NotFound if it does not exist.
  virtual Result<std::vector<std::string>> List(const std::string& dir) = 0;
  virtual bool Exists(const std::string& path) = 0;
  // Size in bytes of the file at `path` (lstat: a symbolic link is not followed).
  virtual Result<std::uint64_t> FileSize(const std::string& path) = 0;
  // Whether `dir` accepts O_DIRECT writes (probed with a small file).
  virtual bool SupportsDirectIo(const std::string& dir) = 0;

  // Writes `content` to `path` atomically: a new temporary file of a random name
  // (path.RANDOM + TmpSuffix()), fdatasync, rename, fsync of the directory. Built from the
  // calls above, so wrappers see each step. The file is 0600 unless `mode` says otherwise.
  Status WriteFileAtomic(const std::string& path, const std::string& content, mode_t mode = 0600);
  // Reads a whole small file.
  Result<std::string> ReadSmallFile(const std::string& path);
};

class PosixStorage : public Storage {
 public:
  Result<UniqueFd> CreateFile(const std::string& path, bool direct) override;
  Result<UniqueFd> OpenForRead(const std::string& path, bool direct) override;
  Status WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                 const std::string& what) override;
  Result<std::size_t> ReadAt(int fd, void* buf, std::size_t len, std::uint64_t offset,
                             const std::string& what) override;
  Status Truncate(int fd, std::uint64_t size, const std::string& what) override;
  Status DataSync(int fd, const std::string& what) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Link(const std::string& from, const std::string& to) override;
  Status SyncDir(const std::string& dir) override;
  Status MakeDirs(const std::string& dir) override;
  Status SetOwner(const std::string& path, uid_t uid, gid_t gid) override;
  Status Remove(const std::string& path) override;
  Result<std::vector<std::string>> List(const std::string& dir) override;
  bool Exists(const std::string& path) override;
  Result<std::uint64_t> FileSize(const std::string& path) override;
  bool SupportsDirectIo(const std::string& dir) override;
};

class StorageWrapper : public Storage {
 public:
  explicit StorageWrapper(std::shared_ptr<Storage> target) : target_(std::move(target)) {}
  Result<UniqueFd> CreateFile(const std::string& p, bool d) override { return target_->CreateFile(p, d); }
  Result<UniqueFd> OpenForRead(const std::string& p, bool d) override { return target_->OpenForRead(p, d); }
  Status WriteAt(int fd, const void* b, std::size_t n, std::uint64_t o, const std::string& w) override {
    return target_->WriteAt(fd, b, n, o, w);
  }
  Result<std::size_t> ReadAt(int fd, void* b, std::size_t n, std::uint64_t o, const std::string& w) override {
    return target_->ReadAt(fd, b, n, o, w);
  }
  Status Truncate(int fd, std::uint64_t s, const std::string& w) override {
    return target_->Truncate(fd, s, w);
  }
  Status DataSync(int fd, const std::string& w) override { return target_->DataSync(fd, w); }
  Status Rename(const std::string& f, const std::string& t) override { return target_->Rename(f, t); }
  Status Link(const std::string& f, const std::string& t) override { return target_->Link(f, t); }
  Status SyncDir(const std::string& d) override { return target_->SyncDir(d); }
  Status MakeDirs(const std::string& d) override { return target_->MakeDirs(d); }
  Status SetOwner(const std::string& p, uid_t u, gid_t g) override { return target_->SetOwner(p, u, g); }
  Status Remove(const std::string& p) override { return target_->Remove(p); }
  Result<std::vector<std::string>> List(const std::string& d) override { return target_->List(d); }
  bool Exists(const std::string& p) override { return target_->Exists(p); }
  Result<std::uint64_t> FileSize(const std::string& p) override { return target_->FileSize(p); }
  bool SupportsDirectIo(const std::string& d) override { return target_->SupportsDirectIo(d); }

 private:
  std::shared_ptr<Storage> target_;
};

}  // namespace ckpt
