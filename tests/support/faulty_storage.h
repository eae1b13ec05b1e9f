// FaultyStorage: the real file system (PosixStorage) with faults a test switches on, one
// call at a time, as the StorageWrapper contract intends: the n-th write fails with an
// errno (ENOSPC by default; optionally only for paths containing some text), or creating a
// file, fdatasync, a directory fsync or a rename to some name fails; and a gate can hold
// every write until the test opens it, standing for a disk that stalls. It counts the
// writes its write faults apply to, fdatasyncs and renames, failed ones included.
//
// Thread-safety: set the fault fields before the engines (or the catalog) using it start;
// their threads only read them. The counters are atomic, and OpenGate may be called from
// any thread.
#pragma once

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "daemon/io/storage.h"

namespace ckpt::test {

class FaultyStorage : public StorageWrapper {
 public:
  FaultyStorage() : StorageWrapper(std::make_shared<PosixStorage>()) {}

  Result<UniqueFd> CreateFile(const std::string& path, bool direct) override;
  Status WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                 const std::string& what) override;
  Status DataSync(int fd, const std::string& what) override;
  Status SyncDir(const std::string& dir) override;
  Status Rename(const std::string& from, const std::string& to) override;
  // Lets every write held by `gate_writes` through, now and from then on.
  void OpenGate();

  std::atomic<int> write_calls{0};
  std::atomic<int> datasync_calls{0};
  std::atomic<int> renames{0};
  // Set before the engines start; read by their threads. Counts are 1-based; 0 means never.
  int fail_write_on = 0;
  int write_errno = ENOSPC;
  std::string fail_only_path;  // restrict write faults to paths containing this
  int create_errno = 0;
  int datasync_errno = 0;
  int syncdir_errno = 0;
  std::string fail_renames_to;  // fail (EIO) every rename whose target ends with this
  bool gate_writes = false;     // block every write until OpenGate()

 private:
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  bool gate_open_ = false;
};

}  // namespace ckpt::test
