#include "tools/ckptctl/export_copy.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "format/checksum.h"

namespace ckptctl::export_internal {
namespace {

using ckpt::DataLoss;
using ckpt::Status;

// One buffer carries every chunk from shard to export.
inline constexpr std::size_t kCopyBufferBytes = 8 << 20;

// Where the runs of elements of one chunk go: the chunk's bytes, front to back, are runs of
// run_bytes contiguous in the global tensor too; RunOffset(i) is where run i starts there.
class ChunkRuns {
 public:
  ChunkRuns(const std::vector<std::int64_t>& global, const ExportChunk& c, std::size_t element) {
    const std::size_t n = global.size();
    // k: the outermost dimension of the run: every dimension inside it is whole in the chunk.
    std::size_t k = n;
    std::uint64_t run = 1;
    while (k > 0) {
      --k;
      run *= static_cast<std::uint64_t>(c.shape[k]);
      if (c.shape[k] != global[k]) break;
    }
    run_bytes_ = run * element;
    strides_.assign(n, element);
    for (std::size_t d = n; d-- > 1;) strides_[d - 1] = strides_[d] * static_cast<std::uint64_t>(global[d]);
    outer_.assign(c.shape.begin(), c.shape.begin() + static_cast<std::ptrdiff_t>(k));
    base_ = 0;
    for (std::size_t d = 0; d < n; ++d) base_ += static_cast<std::uint64_t>(c.offsets[d]) * strides_[d];
  }

  std::uint64_t run_bytes() const { return run_bytes_; }

  std::uint64_t RunOffset(std::uint64_t i) const {
    std::uint64_t off = base_;
    for (std::size_t d = outer_.size(); d-- > 0;) {
      const auto extent = static_cast<std::uint64_t>(outer_[d]);
      off += (i % extent) * strides_[d];
      i /= extent;
    }
    return off;
  }

 private:
  std::uint64_t run_bytes_ = 0;
  std::vector<std::uint64_t> strides_;  // bytes per step of each dimension of the global tensor
  std::vector<std::int64_t> outer_;     // the chunk's extents outside the run
  std::uint64_t base_ = 0;              // where the chunk's first element lies
};

}  // namespace

Status WriteFully(int fd, const char* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, buf + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ckpt::IoError("cannot write " + path, errno);
    done += static_cast<std::size_t>(w);
  }
  return Status::Ok();
}

TensorCopier::TensorCopier(ShardSet& shards, const volatile std::sig_atomic_t* interrupted)
    : shards_(shards), interrupted_(interrupted), buf_(kCopyBufferBytes) {}

Status TensorCopier::Copy(const ExportTensor& t, OutFile& out, std::uint64_t offset,
                          std::vector<std::string>* warnings) {
  if (!t.replicated) {
    for (const auto& c : t.chunks)
      if (Status s = CopyChunk(t, c, out, offset); !s.ok()) return s;
    return Status::Ok();
  }
  // Any copy will do: the first whose checksum holds, in rank order.
  std::vector<const ExportChunk*> copies;
  for (const auto& c : t.chunks) copies.push_back(&c);
  std::stable_sort(copies.begin(), copies.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
  std::string failures;
  for (const ExportChunk* c : copies) {
    Status s = CopyChunk(t, *c, out, offset);
    if (s.ok()) {
      if (!failures.empty()) warnings->push_back(failures);
      return s;
    }
    if (s.code() != ckpt::StatusCode::kDataLoss) return s;
    failures += (failures.empty() ? "" : "; ") + s.message();
  }
  return DataLoss("replicated tensor " + Quote(t.name) + ": no copy is intact: " + failures);
}

Status TensorCopier::CopyChunk(const ExportTensor& t, const ExportChunk& c, OutFile& out,
                               std::uint64_t offset) {
  auto shard = shards_.Get(c.rank);
  if (!shard.ok()) return shard.status();
  OpenShard& s = *shard.value();
  const std::size_t index = s.by_key.at(c.key);
  const ckpt::ShardItem& item = s.info.items[index];
  const std::size_t element = t.kind == ExportTensor::Kind::kBlob ? 1 : ckpt::DTypeSize(t.dtype);
  const ChunkRuns runs(t.shape, c, element);
  // A differential shard's unchanged items are read from its base.
  const std::string& from = *s.files.Locate(index).path;
  ckpt::Checksum sum;
  std::uint64_t run = 0, within = 0;
  for (std::uint64_t done = 0; done < item.length;) {
    if (interrupted_ && *interrupted_) return ckpt::Cancelled("interrupted");
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(buf_.size(), item.length - done));
    if (Status st = s.files.Read(index, done, buf_.data(), want); !st.ok()) return st;
    sum.Update(buf_.data(), want);
    for (std::size_t p = 0; p < want;) {
      const auto take =
          static_cast<std::size_t>(std::min<std::uint64_t>(runs.run_bytes() - within, want - p));
      if (Status st = WriteFully(out.fd.get(), buf_.data() + p, take, offset + runs.RunOffset(run) + within,
                                 out.path);
          !st.ok())
        return st;
      p += take;
      within += take;
      if (within == runs.run_bytes()) {
        ++run;
        within = 0;
      }
    }
    done += want;
  }
  if (sum.Digest() != item.checksum)
    return DataLoss("corrupted shard " + from + " (rank " + std::to_string(c.rank) + "): item " +
                    Quote(c.key) +
                    (t.kind == ExportTensor::Kind::kGlobal
                         ? ", chunk " + BoxText(c.offsets, c.shape) + " of tensor " + Quote(t.name)
                         : "") +
                    ", fails its checksum (stored " + ckpt::ChecksumHex(item.checksum) + ", computed " +
                    ckpt::ChecksumHex(sum.Digest()) + ")");
  return Status::Ok();
}

}  // namespace ckptctl::export_internal
