// FaultStorage: a test seam of the real daemon binary, in the style of CKPTD_TEST_PAUSE. It
// wraps the daemon's Storage and makes chosen calls on chosen files of the commit protocol
// fail (ENOSPC, EIO, EROFS, a short write) or go slowly, so the fault matrix
// (tests/fault_matrix_test.cc) can check what a trainer and `ckptctl status` see when the
// disk misbehaves under a real daemon, and that the daemon commits again once it stops.
//
//   CKPTD_TEST_FAULT=file=KIND,op=OP,fault=FAULT[,while=PATH][,count=N][,under=DIR][,delay_ms=MS]
//
//   KIND   data (a shard's data), header (a shard's header: its write at offset 0), done
//          (VERSION/node-OWNER.K.done), ranks (JOB/ranks/rank-R and rank-R.G.REG), committed (VERSION/COMMITTED),
//          latest (JOB/latest), owner (JOB/owner), any. A file is known by its final name; its .tmp counts.
//   OP     write (default), create, datasync, rename (matched on the target), any.
//   FAULT  ENOSPC, EIO, EROFS (the call fails with that errno); short (a write writes half
//          its bytes, then fails as a write that made no progress); slow (the call waits
//          delay_ms, default 100, then goes through); hold (the call waits as long as the
//          `while` PATH exists, at most 60 s, then goes through: a test holds a daemon at
//          one step while another acts, and lets it go by removing PATH).
//   PATH   the fault applies only while PATH exists: the test "removes the fault" by
//          removing PATH, without restarting the daemon.
//   N      only the first N matching calls (while PATH exists) fail; default all.
//   DIR    only files under DIR (e.g. the persistent root, to break promotions and not
//          the local tier's writes); default anywhere.
//
// Errors say "(injected by CKPTD_TEST_FAULT)". Unset (always, outside tests), nothing is
// wrapped; an unparsable value stops the daemon at start. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "daemon/io/storage.h"

namespace ckpt {

struct FaultSpec {
  enum class File { kAny, kData, kHeader, kDone, kRanks, kCommitted, kLatest, kOwner };
  enum class Op { kAny, kWrite, kCreate, kDataSync, kRename };
  enum class Fault { kErrno, kShort, kSlow, kHold };

  File file = File::kAny;
  Op op = Op::kWrite;
  Fault fault = Fault::kErrno;
  int err = 0;              // for kErrno
  std::string while_path;   // empty: always armed
  std::uint64_t count = 0;  // 0: every matching call
  std::string under;        // empty: anywhere
  std::uint32_t delay_ms = 100;

  // Parses the value of CKPTD_TEST_FAULT (format above).
  static Result<FaultSpec> Parse(std::string_view text);
};

class FaultStorage : public StorageWrapper {
 public:
  FaultStorage(std::shared_ptr<Storage> target, FaultSpec spec)
      : StorageWrapper(std::move(target)), spec_(std::move(spec)) {}

  Result<UniqueFd> CreateFile(const std::string& path, bool direct) override;
  Status WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                 const std::string& what) override;
  Status DataSync(int fd, const std::string& what) override;
  Status Rename(const std::string& from, const std::string& to) override;

 private:
  // Whether this call (`op` on `path`; `offset` for writes) gets the fault, counting it.
  bool Hits(FaultSpec::Op op, const std::string& path, std::int64_t offset);
  Status Injected(const std::string& call) const;
  // Whether the fault delays the call (slow, hold) rather than failing it; the delay.
  bool Delays() const;
  void Delay() const;

  const FaultSpec spec_;
  std::atomic<std::uint64_t> hits_{0};
};

// `storage`, wrapped in a FaultStorage when CKPTD_TEST_FAULT is set.
Result<std::shared_ptr<Storage>> WrapWithTestFault(std::shared_ptr<Storage> storage);

}  // namespace ckpt
