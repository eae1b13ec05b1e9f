#include "daemon/pipeline/shard_copier.h"
#include "common/align.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/test_pause.h"
#include "format/paths.h"
#include "format/shard_format.h"

namespace ckpt {
Result<std::uint64_t> ShardCopier::Copy(const Source& src, const Target& dst) {
  const std::string final_path = JoinPath(dst.dir, dst.name);
  const std::string tmp_path = final_path + TmpSuffix();
  const std::string marker = JoinPath(dst.dir, kCommittedMarker);
  if (storage_->Exists(marker)) {
    return FailedPrecondition(dst.dir + " is committed; its shard " + dst.name + " is not replaced");
  }
  TestPause("promote-start", dst.version);
  if (Status s = storage_->MakeDirs(dst.dir); !s.ok()) return s;
  const DifferentialPlan* plan = dst.differential;
  // A differential shard gathers pieces at any offset: its source is read buffered.
  const bool read_direct = src.direct_io && plan == nullptr;
  UniqueFd in;
  if (!src.image) {
    auto fd = storage_->OpenForRead(src.path, read_direct);
    if (!fd.ok()) return fd.status();
    in = std::move(fd).value();
    struct stat st {};
    if (plan != nullptr && plan->source_ino != 0 &&
        (::fstat(in.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != plan->source_dev ||
         static_cast<std::uint64_t>(st.st_ino) != plan->source_ino)) {
      return FailedPrecondition(src.path + " was replaced after its differential write was planned");
    }
  }
  auto out = storage_->CreateFile(tmp_path, dst.direct_io);
  if (!out.ok()) return out.status();

  const std::uint64_t piece = pool_.chunk_bytes();
  const std::uint64_t out_bytes = plan ? plan->file_bytes : src.file_bytes;
  const std::uint64_t pieces = (out_bytes + piece - 1) / piece;
  std::atomic<std::uint64_t> next{0}, done{0}, read_bytes{0};
  // Differential: where each range of the plan starts in the file written.
  std::vector<std::uint64_t> range_at;
  if (plan) {
    std::uint64_t at = plan->header.size();
    for (const auto& r : plan->ranges) {
      range_at.push_back(at);
      at += r.length;
    }
  }
  // Fills `out` with bytes [off, off + len) of the differential file.
  auto gather = [&](char* out, std::uint64_t off, std::uint64_t len) -> Status {
    const std::uint64_t end = off + len;
    if (off < plan->header.size()) {
      const std::uint64_t n = std::min<std::uint64_t>(end, plan->header.size()) - off;
      std::memcpy(out, plan->header.data() + off, n);
    }
    auto first = std::upper_bound(range_at.begin(), range_at.end(), off);
    std::size_t k = first == range_at.begin() ? 0 : static_cast<std::size_t>(first - range_at.begin()) - 1;
    for (; k < plan->ranges.size() && range_at[k] < end; ++k) {
      const std::uint64_t lo = std::max(off, range_at[k]);
      const std::uint64_t hi = std::min(end, range_at[k] + plan->ranges[k].length);
      if (lo >= hi) continue;
      const std::uint64_t from = plan->ranges[k].from + (lo - range_at[k]);
      char* to = out + (lo - off);
      if (src.image) {
        std::memcpy(to, src.image->data() + from, hi - lo);
        continue;
      }
      for (std::uint64_t got = 0; got < hi - lo;) {
        auto r = storage_->ReadAt(in.get(), to + got, hi - lo - got, from + got, src.path);
        if (!r.ok()) return r.status();
        if (r.value() == 0) return DataLoss(src.path + " ended early (truncated shard)");
        got += r.value();
      }
      read_bytes += hi - lo;
    }
    return Status::Ok();
  };
  Mutex mu;
  Status first_error;
  auto fail = [&](Status s) {
    MutexLock lock(mu);
    if (first_error.ok()) first_error = std::move(s);
  };
  auto failed = [&] {
    MutexLock lock(mu);
    return !first_error.ok();
  };
  auto worker = [&] {
    for (;;) {
      std::uint64_t i = next.fetch_add(1);
      if (i >= pieces || failed()) return;
      if (dst.abandon && dst.abandon->load()) {
        fail(Cancelled("copy to " + final_path + " abandoned"));
        return;
      }
      const std::uint64_t off = i * piece;
      const std::uint64_t len = std::min(piece, out_bytes - off);
      // O_DIRECT writes the last piece padded to a whole block; the file is cut after.
      const std::uint64_t wlen = dst.direct_io ? AlignUp(len, kDataAlignment) : len;
      const char* buf = nullptr;
      std::optional<HostPool::Chunk> chunk;
      if (plan) {
        chunk = pool_.Acquire();
        if (!chunk) {
          fail(FailedPrecondition("daemon is shutting down"));
          return;
        }
        if (Status g = gather(chunk->data, off, len); !g.ok()) {
          pool_.Release(*chunk);
          fail(g);
          return;
        }
        if (wlen > len) std::memset(chunk->data + len, 0, wlen - len);
        buf = chunk->data;
      } else if (src.image) {
        buf = src.image->data() + off;  // zero padded to a whole page
      } else {
        chunk = pool_.Acquire();
        if (!chunk) {
          fail(FailedPrecondition("daemon is shutting down"));
          return;
        }
        const std::uint64_t rlen = src.direct_io ? AlignUp(len, kDataAlignment) : len;
        auto got = storage_->ReadAt(in.get(), chunk->data, rlen, off, src.path);
        if (!got.ok() || got.value() < len) {
          pool_.Release(*chunk);
          fail(got.ok() ? DataLoss(src.path + " ended early (truncated shard)") : got.status());
          return;
        }
        read_bytes += len;
        if (wlen > len) std::memset(chunk->data + len, 0, wlen - len);
        buf = chunk->data;
      }
      Status s = storage_->WriteAt(out->get(), buf, wlen, off, tmp_path);
      if (chunk) pool_.Release(*chunk);
      if (!s.ok()) {
        fail(s);
        return;
      }
      if (done.fetch_add(1) + 1 == (pieces + 1) / 2) TestPause("promote", dst.version);
    }
  };
  {
    std::vector<std::thread> threads;
    const unsigned n =
        static_cast<unsigned>(std::min<std::uint64_t>(streams_, std::max<std::uint64_t>(pieces, 1)));
    for (unsigned t = 1; t < n; ++t) threads.emplace_back(worker);
    worker();
    for (auto& t : threads) t.join();
  }
  Status s = first_error;
  // The last pieces may all have been written by the time it was abandoned.
  if (s.ok() && dst.abandon && dst.abandon->load()) s = Cancelled("copy to " + final_path + " abandoned");
  if (s.ok() && dst.direct_io && out_bytes % kDataAlignment != 0) {
    s = storage_->Truncate(out->get(), out_bytes, tmp_path);
  }
  if (s.ok()) s = storage_->DataSync(out->get(), tmp_path);
  out->reset();
  if (s.ok() && storage_->Exists(marker)) {
    s = FailedPrecondition(dst.dir + " was committed meanwhile; its shard " + dst.name + " is not replaced");
  }
  if (s.ok()) s = storage_->Rename(tmp_path, final_path);
  if (s.ok()) s = storage_->SyncDir(dst.dir);
  if (s.ok()) s = storage_->SyncDir(dst.dir.substr(0, dst.dir.find_last_of('/')));
  if (!s.ok()) {
    storage_->Remove(tmp_path);
    return s;
  }
  return read_bytes.load();
}

}  // namespace ckpt
