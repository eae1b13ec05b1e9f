// CountingStorage: a StorageWrapper that counts the metadata operations going through it,
// by kind, so that a benchmark (bench/commit_scale.cc) or a test can say what a protocol
// costs a parallel file system's metadata servers. Data reads and writes of an open file
// are not metadata and are not counted; fdatasync and directory fsyncs are (on a network
// file system each is a round trip to the servers). Header-only: the commit-scale bench
// builds it against older trees too. Thread-safe (relaxed atomics: totals, not an order).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "daemon/io/storage.h"

namespace ckpt {

struct MetaOps {
  std::uint64_t open = 0;     // CreateFile, OpenForRead
  std::uint64_t stat = 0;     // Exists, FileSize
  std::uint64_t readdir = 0;  // List
  std::uint64_t rename = 0;
  std::uint64_t unlink = 0;  // Remove
  std::uint64_t mkdir = 0;   // MakeDirs (one call, whatever depth)
  std::uint64_t link = 0;
  std::uint64_t fsync = 0;  // DataSync, SyncDir
  std::uint64_t total() const { return open + stat + readdir + rename + unlink + mkdir + link + fsync; }
  MetaOps operator-(const MetaOps& o) const {
    return {open - o.open,     stat - o.stat,   readdir - o.readdir, rename - o.rename,
            unlink - o.unlink, mkdir - o.mkdir, link - o.link,       fsync - o.fsync};
  }
};

class CountingStorage : public StorageWrapper {
 public:
  explicit CountingStorage(std::shared_ptr<Storage> target) : StorageWrapper(std::move(target)) {}

  MetaOps counts() const {
    return {open_.load(),   stat_.load(),  readdir_.load(), rename_.load(),
            unlink_.load(), mkdir_.load(), link_.load(),    fsync_.load()};
  }

  Result<UniqueFd> CreateFile(const std::string& p, bool d) override {
    ++open_;
    return StorageWrapper::CreateFile(p, d);
  }
  Result<UniqueFd> OpenForRead(const std::string& p, bool d) override {
    ++open_;
    return StorageWrapper::OpenForRead(p, d);
  }
  Status DataSync(int fd, const std::string& w) override {
    ++fsync_;
    return StorageWrapper::DataSync(fd, w);
  }
  Status Rename(const std::string& f, const std::string& t) override {
    ++rename_;
    return StorageWrapper::Rename(f, t);
  }
  Status Link(const std::string& f, const std::string& t) override {
    ++link_;
    return StorageWrapper::Link(f, t);
  }
  Status SyncDir(const std::string& d) override {
    ++fsync_;
    return StorageWrapper::SyncDir(d);
  }
  Status MakeDirs(const std::string& d) override {
    ++mkdir_;
    return StorageWrapper::MakeDirs(d);
  }
  Status Remove(const std::string& p) override {
    ++unlink_;
    return StorageWrapper::Remove(p);
  }
  Result<std::vector<std::string>> List(const std::string& d) override {
    ++readdir_;
    return StorageWrapper::List(d);
  }
  bool Exists(const std::string& p) override {
    ++stat_;
    return StorageWrapper::Exists(p);
  }
  Result<std::uint64_t> FileSize(const std::string& p) override {
    ++stat_;
    return StorageWrapper::FileSize(p);
  }

 private:
  std::atomic<std::uint64_t> open_{0}, stat_{0}, readdir_{0}, rename_{0}, unlink_{0}, mkdir_{0}, link_{0},
      fsync_{0};
};

}  // namespace ckpt
