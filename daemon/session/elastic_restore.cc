// ElasticRestore's execution (elastic_restore.h, steps 3 and 4): the planned pieces read and
// verified into staging buffers on the reader threads, a bad copy dropped and the plan made
// again, and only then the regions written. The plan is elastic_plan.cc's.
#include "daemon/session/elastic_restore.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/names.h"
#include "common/run_parallel.h"
#include "daemon/session/elastic_run.h"
#include "format/checksum.h"

namespace ckpt {
namespace elastic_internal {

Status ElasticRun::RunTask(const Task& t, ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                           std::vector<char>& buf, std::uint64_t& read) {
  const Piece& p = pieces_[t.piece];
  const LoadedShard& s = *shards_[p.shard];
  const ShardItem& item = *p.item;
  const std::string what = p.global + ", item " + QuoteName(item.name) + " of " + s.Where() + " (rank " +
                           std::to_string(s.rank) + ")";
  // Windows of whole blocks (p.blocks: no larger than a window), or of any size when the
  // item is verified whole (a multiple of every element size).
  const std::uint64_t window =
      p.blocks == nullptr ? kReadWindow : kReadWindow / p.blocks->block_bytes * p.blocks->block_bytes;
  Checksum whole;  // p.blocks == nullptr: the task is the whole item
  for (std::uint64_t lo = t.lo; lo < t.hi;) {
    const std::uint64_t n = std::min(window, t.hi - lo);
    const char* data = nullptr;
    if (s.src().image) {
      data = s.src().image->data() + s.info.data_start + item.offset + lo;
    } else {
      buf.resize(static_cast<std::size_t>(n));
      const auto [fd, at] = s.FileAt(item, lo);
      const std::string& from =
          s.files ? *s.files->Locate(static_cast<std::size_t>(&item - s.info.items.data())).path : s.src().path;
      std::uint64_t got = 0;
      while (got < n) {
        auto r = storage_.ReadAt(fd, buf.data() + got, n - got, at + got, from);
        if (!r.ok()) return r.status();
        if (r.value() == 0) return DataLoss(from + " ended early (truncated shard)");
        got += r.value();
      }
      read += n;
      data = buf.data();
    }
    if (p.blocks == nullptr) {
      whole.Update(data, n);
    } else if (Status st = VerifyBlocks(*p.blocks, item.length, lo, data, n, what); !st.ok()) {
      return st;
    }
    // Into daemon memory only (a blob, a staging buffer): what reaches a region is written
    // once every piece is verified.
    if (p.target == SIZE_MAX) {
      std::memcpy(out.blobs[p.blob].data.data() + lo, data, n);
    } else if (staging[p.target]) {
      // A target with no staging buffer is written straight from the memory images later.
      CopySubBox(p.sub, p.chunk, data, lo, p.dst, staging[p.target].get(), p.elem, lo, lo + n);
    }
    lo += n;
  }
  if (p.blocks == nullptr && whole.Digest() != item.checksum) {
    return DataLoss(p.global + ": checksum mismatch in item " + QuoteName(item.name) + " of " + s.Where() +
                    " (rank " + std::to_string(s.rank) + ", stored " + ChecksumHex(item.checksum) +
                    ", read " + ChecksumHex(whole.Digest()) + ")");
  }
  return Status::Ok();
}

Status ElasticRun::Read(ElasticRestored& out, std::vector<std::unique_ptr<char[]>>& staging,
                        std::map<std::size_t, Status>& bad) {
  std::vector<Task> tasks;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    if (p.item->length == 0) continue;
    if (p.blocks == nullptr) {
      tasks.push_back({k, 0, p.item->length});
      continue;
    }
    const std::uint64_t bb = p.blocks->block_bytes;
    for (const auto& [b, e] : TouchedBlocks(TouchedRanges(p.chunk, p.sub, p.elem), bb, p.item->length)) {
      for (std::uint64_t x = b; x < e; x += kTaskBlocks) {
        tasks.push_back({k, x * bb, std::min(std::min(e, x + kTaskBlocks) * bb, p.item->length)});
      }
    }
  }
  // Zero-length items verify against the checksum of nothing.
  for (const Piece& p : pieces_) {
    if (p.item->length == 0 && p.item->checksum != Checksum::Of(nullptr, 0)) {
      return DataLoss(p.global + ": checksum mismatch in empty item " + QuoteName(p.item->name) + " of " +
                      shards_[p.shard]->Where());
    }
  }
  std::vector<Status> status(tasks.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> read_total{0};
  RunParallel(std::min<unsigned>(readers_, static_cast<unsigned>(std::max<std::size_t>(1, tasks.size()))),
              [&] {
                std::vector<char> buf;
                std::uint64_t read = 0;
                while (!stop.load()) {
                  const std::size_t k = next.fetch_add(1);
                  if (k >= tasks.size()) break;
                  status[k] = RunTask(tasks[k], out, staging, buf, read);
                  if (!status[k].ok() &&
                      !WorthNextCopy(status[k], shards_[pieces_[tasks[k].piece].shard]->src().tier))
                    stop.store(true);
                }
                read_total += read;
              });
  out.bytes_read += read_total.load();
  // A bad copy on a faster tier: the caller drops it and plans again; anything else ends here.
  Status fatal;
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    if (status[k].ok()) continue;
    const std::size_t shard = pieces_[tasks[k].piece].shard;
    if (!WorthNextCopy(status[k], shards_[shard]->src().tier)) {
      if (fatal.ok()) fatal = status[k];
    } else if (bad.count(shard) == 0) {
      bad[shard] = status[k];
    }
  }
  return fatal;
}

}  // namespace elastic_internal

namespace {

using elastic_internal::ElasticRun;
using elastic_internal::LoadedShard;
using elastic_internal::Piece;

// Host regions are written in pieces of this size, several at once.
constexpr std::uint64_t kWritePiece = 8ull << 20;

Status Noted(const Status& s, const std::string& note) {
  return Status(s.code(), s.message() + " (" + note + ")");
}

}  // namespace

Result<ElasticRestored> ElasticRestore::Restore(const ElasticRequest& req) {
  ElasticRun run(*storage_, tiers_, errors_, req, readers_, limits_);
  if (Status st = run.LoadAll(); !st.ok()) return Noted(st, "nothing was written to the registered regions");
  // A target is staged (its verified pieces copied into a buffer of its size) when a piece
  // comes from a file, which could change between verification and copy, or when its region
  // is device memory (copied through the lanes from one buffer). A host target whose pieces
  // are all in memory images, which do not change, is written straight from them.
  std::vector<std::unique_ptr<char[]>> staging(req.targets.size());
  ElasticRestored out;
  while (true) {
    if (Status st = run.Plan(out); !st.ok())
      return Noted(st, "nothing was written to the registered regions");
    std::vector<bool> staged(req.targets.size(), false);
    for (std::size_t i = 0; i < req.targets.size(); ++i)
      staged[i] = req.targets[i].target.region->device() >= 0;
    for (const Piece& p : run.pieces()) {
      if (p.target != SIZE_MAX && !run.shard(p.shard).src().image) staged[p.target] = true;
    }
    for (std::size_t i = 0; i < req.targets.size(); ++i) {
      if (staged[i] && !staging[i]) {
        staging[i].reset(new char[std::max<std::uint64_t>(1, req.targets[i].target.item.length)]);
      }
      if (!staged[i]) staging[i].reset();
    }
    std::map<std::size_t, Status> bad;  // by rank
    if (Status st = run.Read(out, staging, bad); !st.ok()) {
      return Noted(st, "nothing was written to the registered regions");
    }
    const bool retry = !bad.empty();
    for (const auto& [r, why] : bad) {
      run.BadCopy(run.shard(r), why);
      if (Status st = run.Load(run.shard(r)); !st.ok()) {
        return Noted(st, "nothing was written to the registered regions");
      }
    }
    if (!retry) break;
  }
  for (const Piece& p : run.pieces()) {
    const Tier tier = run.shard(p.shard).src().tier;
    out.slowest = SlowerTier(out.slowest, tier);
    if (p.target != SIZE_MAX) {
      const std::uint64_t bytes = p.sub.elements() * p.elem;
      out.tier_bytes[static_cast<int>(tier)] += bytes;
      out.tensor_bytes += bytes;
    }
  }

  // Everything is verified: write the staging buffers, or the pieces straight from the
  // memory images, to the regions.
  struct Write {
    std::size_t target;
    std::uint64_t at, len;  // in the item
    const char* src;
  };
  std::vector<Write> host;
  std::map<int, std::vector<Write>> device;
  auto add = [&](std::size_t i, std::uint64_t at, std::uint64_t len, const char* src) {
    for (std::uint64_t done = 0; done < len; done += kWritePiece) {
      Write w{i, at + done, std::min(kWritePiece, len - done), src + done};
      const int dev = req.targets[i].target.region->device();
      (dev < 0 ? host : device[dev]).push_back(w);
    }
  };
  for (std::size_t i = 0; i < req.targets.size(); ++i) {
    if (staging[i]) add(i, 0, req.targets[i].target.item.length, staging[i].get());
  }
  for (const Piece& p : run.pieces()) {
    if (p.target == SIZE_MAX || staging[p.target]) continue;
    const LoadedShard& s = run.shard(p.shard);
    const char* item = s.src().image->data() + s.info.data_start + p.item->offset;
    for (const BoxRun& r : SubBoxRuns(p.sub, p.chunk, p.dst, p.elem))
      add(p.target, r.dst, r.bytes, item + r.src);
  }
  const std::string partly = "the registered regions are partly written: do not train on them";
  for (const auto& [dev, writes] : device) {
    if (backend_ == nullptr) {
      return FailedPrecondition("region " + req.targets[writes.front().target].target.region->name() +
                                " is device memory, and this daemon has no device backend");
    }
    auto lanes = backend_->MakeLanes(dev, std::max(1u, lanes_));
    if (!lanes.ok()) return lanes.status().With("create copy streams for a restore");
    std::vector<std::pair<CopyLane*, std::uint64_t>> tickets;
    Status copied;
    for (std::size_t k = 0; k < writes.size() && copied.ok(); ++k) {
      const Write& w = writes[k];
      const RestoreTarget& t = req.targets[w.target].target;
      CopyLane& lane = *lanes.value()[k % lanes.value().size()];
      copied = lane.CopyIn(*t.region, t.region_offset + w.at, w.src, w.len);
      if (!copied.ok()) copied = copied.With("restore item " + QuoteName(t.item.name));
      auto ticket = lane.EndChunk();
      if (ticket.ok()) {
        tickets.emplace_back(&lane, ticket.value());
      } else if (copied.ok()) {
        copied = ticket.status();
      }
    }
    for (auto& [lane, ticket] : tickets) {
      Status s = lane->WaitChunk(ticket, [] { return false; });
      if (copied.ok() && !s.ok()) copied = s;
    }
    if (!copied.ok()) return Noted(copied, partly);
  }
  for (const auto& et : req.targets) {
    if (et.target.region->device() < 0)
      et.target.region->Preallocate(et.target.region_offset, et.target.item.length);
  }
  std::vector<Status> written(host.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  RunParallel(std::min<unsigned>(std::max(1u, readers_),
                                 static_cast<unsigned>(std::max<std::size_t>(1, host.size()))),
              [&] {
                while (!failed.load()) {
                  const std::size_t k = next.fetch_add(1);
                  if (k >= host.size()) break;
                  const Write& w = host[k];
                  const RestoreTarget& t = req.targets[w.target].target;
                  Status s = t.region->WriteAt(t.region_offset + w.at, w.src, w.len);
                  if (!s.ok()) {
                    written[k] = s.With("restore item " + QuoteName(t.item.name));
                    failed.store(true);
                  }
                }
              });
  for (const Status& s : written) {
    if (!s.ok()) return Noted(s, partly);
  }
  return out;
}

Result<bool> ElasticRestore::MatchesOwnShard(const ElasticRequest& req, ShardSource* fetched) {
  ElasticRun run(*storage_, tiers_, errors_, req, readers_, limits_);
  LoadedShard s;
  s.rank = req.rank;
  if (Status st = run.Load(s); !st.ok()) return st;
  if (fetched != nullptr && s.src().tier == Tier::kPeer && s.src().image) *fetched = s.src();
  if (s.tensors.size() != req.targets.size()) return false;
  for (const ElasticTarget& t : req.targets) {
    auto it = s.tensors.find(t.target.item.name);
    if (it == s.tensors.end() || it->second->shape != t.target.item.shape ||
        it->second->dtype != t.target.item.dtype) {
      return false;
    }
    // Both resolved: equal when the item is the same box of the same global tensor.
    if (it->second->layout != t.layout) return false;
  }
  return true;
}

}  // namespace ckpt
