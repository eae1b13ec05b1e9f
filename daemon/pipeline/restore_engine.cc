#include "daemon/pipeline/restore_engine.h"

#include <sys/stat.h>

#include <algorithm>
#include <deque>
#include <future>
#include <map>
#include <system_error>

#include "common/names.h"
#include "format/checksum.h"

namespace ckpt {
namespace {

std::string ShapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Where each shard item's bytes go: a target region, or a blob string.
struct Destination {
  const RestoreTarget* target = nullptr;
  std::string* blob = nullptr;
};

Status MatchLayout(const ShardInfo& info, const std::vector<RestoreTarget>& targets) {
  std::map<std::string, const ShardItem*> stored;
  for (const auto& item : info.items) {
    if (item.kind == ItemKind::kTensor) stored[item.name] = &item;
  }
  for (const auto& t : targets) {
    auto it = stored.find(t.item.name);
    if (it == stored.end()) {
      return FailedPrecondition("the checkpoint has no tensor item " + QuoteName(t.item.name) +
                                ", which this trainer registered");
    }
    const ShardItem& s = *it->second;
    if (s.dtype != t.item.dtype) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " is " + std::string(DTypeName(s.dtype)) +
                                " in the checkpoint but registered as " +
                                std::string(DTypeName(t.item.dtype)));
    }
    if (s.shape != t.item.shape) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " has shape " + ShapeText(s.shape) +
                                " in the checkpoint but is registered with shape " + ShapeText(t.item.shape));
    }
    if (s.length != t.item.length) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " has " + std::to_string(s.length) +
                                " bytes in the checkpoint but " + std::to_string(t.item.length) +
                                " registered");
    }
    stored.erase(it);
  }
  if (!stored.empty()) {
    return FailedPrecondition("the checkpoint has tensor item " + QuoteName(stored.begin()->first) +
                              " (and " + std::to_string(stored.size() - 1) +
                              " more) that this trainer did not register");
  }
  return Status::Ok();
}

// Takes a shard's data section in order, in pieces of any size: checks each item's
// checksum as its last byte passes and puts the bytes where they belong.
class ItemSink {
 public:
  ItemSink(std::string what, const ShardInfo& info, const std::vector<RestoreTarget>& targets,
           RestoredShard& out)
      : what_(std::move(what)), items_(info.items), dest_(items_.size()) {
    std::map<std::string, const RestoreTarget*> by_name;
    for (const auto& t : targets) by_name[t.item.name] = &t;
    for (std::size_t i = 0; i < items_.size(); ++i) {
      if (items_[i].kind == ItemKind::kBlob) {
        out.blobs.emplace_back(items_[i].name, std::string());
        out.blobs.back().second.reserve(items_[i].length);
      } else {
        dest_[i].target = by_name.at(items_[i].name);
        out.tensor_bytes += items_[i].length;
      }
    }
    // Pointers into out.blobs are taken once it no longer grows.
    for (std::size_t i = 0, b = 0; i < items_.size(); ++i) {
      if (items_[i].kind == ItemKind::kBlob) dest_[i].blob = &out.blobs[b++].second;
    }
  }

  // Items of zero length at the start are complete before any byte.
  Status Begin() { return CloseItems(); }

  Status Consume(const char* src, std::uint64_t want) {
    std::uint64_t used = 0;
    while (used < want) {
      const ShardItem& it = items_[item_];
      std::size_t n = static_cast<std::size_t>(std::min(want - used, it.length - in_item_));
      sum_.Update(src + used, n);
      if (dest_[item_].blob != nullptr) {
        dest_[item_].blob->append(src + used, n);
      } else {
        const RestoreTarget& t = *dest_[item_].target;
        if (Status s = t.region->WriteAt(t.region_offset + in_item_, src + used, n); !s.ok()) {
          return s.With("item " + it.name);
        }
      }
      used += n;
      in_item_ += n;
      if (Status s = CloseItems(); !s.ok()) return s;
    }
    return Status::Ok();
  }

 private:
  Status CloseItems() {
    while (item_ < items_.size() && in_item_ == items_[item_].length) {
      if (sum_.Digest() != items_[item_].checksum) {
        return DataLoss(what_ + ": checksum mismatch in item " + QuoteName(items_[item_].name) + " (stored " +
                        ChecksumHex(items_[item_].checksum) + ", read " + ChecksumHex(sum_.Digest()) + ")");
      }
      sum_ = Checksum();
      ++item_;
      in_item_ = 0;
    }
    return Status::Ok();
  }

  std::string what_;
  const std::vector<ShardItem>& items_;
  std::vector<Destination> dest_;
  std::size_t item_ = 0;
  std::uint64_t in_item_ = 0;
  Checksum sum_;
};

}  // namespace

Result<RestoredShard> RestoreEngine::Restore(const std::string& path,
                                             const std::vector<RestoreTarget>& targets, bool direct_io) {
  // One buffered descriptor for the header; an O_DIRECT one for the data is checked to be
  // the same file, so a shard renamed over the path in between is not read half and half.
  UniqueFd header_fd;
  if (auto opened = storage_->OpenForRead(path, /*direct=*/false); opened.ok()) {
    header_fd = std::move(opened.value());
  } else {
    return opened.status();
  }
  auto info = ReadShardHeader(header_fd.get(), path);
  if (!info.ok()) return info.status();
  if (Status s = MatchLayout(info.value(), targets); !s.ok()) return s;

  RestoredShard out;
  ItemSink sink(path, info.value(), targets, out);
  UniqueFd data_fd;
  if (!direct_io) {
    data_fd = std::move(header_fd);
  } else if (auto opened = storage_->OpenForRead(path, /*direct=*/true); opened.ok()) {
    data_fd = std::move(opened.value());
    struct stat a {
    }, b{};
    if (::fstat(header_fd.get(), &a) != 0 || ::fstat(data_fd.get(), &b) != 0 || a.st_ino != b.st_ino ||
        a.st_dev != b.st_dev) {
      return DataLoss(path + " was replaced while it was being restored");
    }
  } else {
    return opened.status();
  }
  // Reads start at the 4 KiB boundary at or before the data section, as O_DIRECT needs: a
  // valid shard from another writer may put its data anywhere after the header.
  const std::uint64_t read_start = info->data_start / kDataAlignment * kDataAlignment;
  const std::uint64_t skip = info->data_start - read_start;
  const std::uint64_t read_bytes = info->file_bytes - read_start;
  const std::uint64_t chunk_bytes = pool_.chunk_bytes();
  const std::uint64_t chunks = (read_bytes + chunk_bytes - 1) / chunk_bytes;
  const unsigned window = std::max(1u, readers_);

  struct Pending {
    HostPool::Chunk chunk;
    std::future<Result<std::size_t>> read;
  };
  std::deque<Pending> inflight;
  std::uint64_t next = 0;
  // Returns false (and launches nothing) when more reads in flight would need a chunk the
  // pool does not have now: only a restore holding no chunk may block for one.
  auto launch = [&]() -> Result<bool> {
    auto chunk = inflight.empty() ? pool_.Acquire() : pool_.TryAcquire();
    if (!chunk) {
      if (inflight.empty()) return FailedPrecondition("daemon is shutting down");
      return false;
    }
    std::uint64_t offset = read_start + next * chunk_bytes;
    int raw_fd = data_fd.get();
    try {
      inflight.push_back(Pending{
          *chunk, std::async(std::launch::async, [this, raw_fd, c = *chunk, offset, chunk_bytes, &path] {
            return storage_->ReadAt(raw_fd, c.data, chunk_bytes, offset, path);
          })});
    } catch (const std::system_error& e) {  // no thread could be started
      pool_.Release(*chunk);
      return Internal(std::string("cannot start a reader thread: ") + e.what());
    }
    ++next;
    return true;
  };
  auto drain = [&] {
    for (auto& p : inflight) {
      p.read.wait();
      pool_.Release(p.chunk);
    }
    inflight.clear();
  };

  if (Status s = sink.Begin(); !s.ok()) return s;

  for (std::uint64_t k = 0; k < chunks; ++k) {
    while (next < chunks && inflight.size() < window) {
      auto launched = launch();
      if (!launched.ok()) {
        drain();
        return launched.status();
      }
      if (!launched.value()) break;
    }
    Pending p = std::move(inflight.front());
    inflight.pop_front();
    auto got = p.read.get();
    const std::uint64_t want = std::min(chunk_bytes, read_bytes - k * chunk_bytes);
    const std::uint64_t from = k == 0 ? skip : 0;  // header bytes in the first chunk
    Status status = got.ok() ? Status::Ok() : got.status();
    if (status.ok() && got.value() < want) {
      status = DataLoss(path + " ended early (truncated shard)");
    }
    if (status.ok()) status = sink.Consume(p.chunk.data + from, want - from);
    pool_.Release(p.chunk);
    if (status.ok()) out.bytes_read += want - from;
    if (!status.ok()) {
      drain();
      return status;
    }
  }
  return out;
}

Result<RestoredShard> RestoreEngine::RestoreFromImage(const MemoryImage& image,
                                                      const std::vector<RestoreTarget>& targets) {
  const std::string what = "memory image of job '" + image.meta.job + "' version " +
                           std::to_string(image.meta.version) + " rank " + std::to_string(image.meta.rank);
  if (image.file_bytes < 8) return DataLoss(what + " is too short");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(image.data()[i]);
  if (header_len > image.file_bytes - 8) return DataLoss(what + ": header size past the end");
  auto info = ParseShardHeader(std::string_view(image.data() + 8, header_len), image.file_bytes);
  if (!info.ok()) return info.status().With(what);
  if (Status s = MatchLayout(info.value(), targets); !s.ok()) return s;
  RestoredShard out;
  ItemSink sink(what, info.value(), targets, out);
  if (Status s = sink.Begin(); !s.ok()) return s;
  // In pieces, so that device regions get host-to-device copies of a bounded size.
  const std::uint64_t piece = pool_.chunk_bytes();
  for (std::uint64_t off = info->data_start; off < image.file_bytes; off += piece) {
    std::uint64_t n = std::min(piece, image.file_bytes - off);
    if (Status s = sink.Consume(image.data() + off, n); !s.ok()) return s;
  }
  return out;
}

}  // namespace ckpt
