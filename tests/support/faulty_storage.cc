#include "support/faulty_storage.h"

namespace ckpt::test {

Result<UniqueFd> FaultyStorage::CreateFile(const std::string& path, bool direct) {
  if (create_errno != 0) return IoError("create " + path, create_errno);
  return StorageWrapper::CreateFile(path, direct);
}

Status FaultyStorage::WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                              const std::string& what) {
  if (!fail_only_path.empty() && what.find(fail_only_path) == std::string::npos) {
    return StorageWrapper::WriteAt(fd, buf, len, offset, what);
  }
  int n = ++write_calls;
  if (n == fail_write_on) return IoError("write " + what, write_errno);
  if (gate_writes) {
    std::unique_lock lock(gate_mu_);
    gate_cv_.wait(lock, [&] { return gate_open_; });
  }
  return StorageWrapper::WriteAt(fd, buf, len, offset, what);
}

Status FaultyStorage::DataSync(int fd, const std::string& what) {
  ++datasync_calls;
  if (datasync_errno != 0) return IoError("fdatasync " + what, datasync_errno);
  return StorageWrapper::DataSync(fd, what);
}

Status FaultyStorage::SyncDir(const std::string& dir) {
  if (syncdir_errno != 0) return IoError("fsync directory " + dir, syncdir_errno);
  return StorageWrapper::SyncDir(dir);
}

Status FaultyStorage::Rename(const std::string& from, const std::string& to) {
  ++renames;
  const std::string& suffix = fail_renames_to;
  if (!suffix.empty() && to.size() >= suffix.size() &&
      to.compare(to.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return IoError("rename " + from + " to " + to, EIO);
  }
  return StorageWrapper::Rename(from, to);
}

void FaultyStorage::OpenGate() {
  {
    std::lock_guard lock(gate_mu_);
    gate_open_ = true;
  }
  gate_cv_.notify_all();
}

}  // namespace ckpt::test
