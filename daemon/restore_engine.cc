#include "daemon/restore_engine.h"

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
      return FailedPrecondition("item " + QuoteName(t.item.name) + " is " +
                                std::string(DTypeName(s.dtype)) + " in the checkpoint but registered as " +
                                std::string(DTypeName(t.item.dtype)));
    }
    if (s.shape != t.item.shape) {
      return FailedPrecondition("item " + QuoteName(t.item.name) + " has shape " + ShapeText(s.shape) +
                                " in the checkpoint but is registered with shape " +
                                ShapeText(t.item.shape));
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

}  // namespace

Result<RestoredShard> RestoreEngine::Restore(const std::string& path,
                                             const std::vector<RestoreTarget>& targets,
                                             bool direct_io) {
  auto info = ReadShardHeader(path);
  if (!info.ok()) return info.status();
  if (Status s = MatchLayout(info.value(), targets); !s.ok()) return s;

  RestoredShard out;
  std::map<std::string, const RestoreTarget*> by_name;
  for (const auto& t : targets) by_name[t.item.name] = &t;
  const auto& items = info->items;
  std::vector<Destination> dest(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].kind == ItemKind::kBlob) {
      out.blobs.emplace_back(items[i].name, std::string());
      out.blobs.back().second.reserve(items[i].length);
    } else {
      dest[i].target = by_name.at(items[i].name);
      out.tensor_bytes += items[i].length;
    }
  }
  // Pointers into out.blobs are taken once it no longer grows.
  for (std::size_t i = 0, b = 0; i < items.size(); ++i) {
    if (items[i].kind == ItemKind::kBlob) dest[i].blob = &out.blobs[b++].second;
  }

  auto fd = storage_->OpenForRead(path, direct_io);
  if (!fd.ok()) return fd.status();
  const std::uint64_t data_bytes = info->file_bytes - info->data_start;
  const std::uint64_t chunk_bytes = pool_.chunk_bytes();
  const std::uint64_t chunks = (data_bytes + chunk_bytes - 1) / chunk_bytes;
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
    std::uint64_t offset = info->data_start + next * chunk_bytes;
    int raw_fd = fd->get();
    try {
      inflight.push_back(Pending{*chunk, std::async(std::launch::async, [this, raw_fd, c = *chunk, offset,
                                                                        chunk_bytes, &path] {
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

  std::size_t item = 0;
  std::uint64_t in_item = 0;
  Checksum sum;
  auto close_items = [&]() -> Status {
    while (item < items.size() && in_item == items[item].length) {
      if (sum.Digest() != items[item].checksum) {
        return DataLoss(path + ": checksum mismatch in item " + QuoteName(items[item].name) +
                        " (stored " + ChecksumHex(items[item].checksum) + ", read " +
                        ChecksumHex(sum.Digest()) + ")");
      }
      sum = Checksum();
      ++item;
      in_item = 0;
    }
    return Status::Ok();
  };
  if (Status s = close_items(); !s.ok()) return s;

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
    std::uint64_t want = std::min(chunk_bytes, data_bytes - k * chunk_bytes);
    Status status = got.ok() ? Status::Ok() : got.status();
    if (status.ok() && got.value() < want) {
      status = DataLoss(path + " ended early (truncated shard)");
    }
    std::uint64_t used = 0;
    while (status.ok() && used < want) {
      const ShardItem& it = items[item];
      std::size_t n = static_cast<std::size_t>(std::min(want - used, it.length - in_item));
      const char* src = p.chunk.data + used;
      sum.Update(src, n);
      if (dest[item].blob != nullptr) {
        dest[item].blob->append(src, n);
      } else {
        const RestoreTarget& t = *dest[item].target;
        status = t.region->WriteAt(t.region_offset + in_item, src, n);
        if (!status.ok()) status = status.With("item " + it.name);
      }
      used += n;
      in_item += n;
      if (status.ok()) status = close_items();
    }
    pool_.Release(p.chunk);
    out.bytes_read += used;
    if (!status.ok()) {
      drain();
      return status;
    }
  }
  return out;
}

}  // namespace ckpt
