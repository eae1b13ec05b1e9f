#include "daemon/session/admission.h"

#include <string_view>
#include <unordered_set>

#include "common/names.h"

namespace ckpt {

Status SnapshotAdmission::ReportEarlierFailure(Session& s, std::uint64_t version) {
  for (;;) {
    std::uint64_t failed;
    {
      MutexLock lock(s.failures_mu);
      if (s.unreported_failures.empty()) return Status::Ok();
      failed = *s.unreported_failures.begin();
      s.unreported_failures.erase(s.unreported_failures.begin());
    }
    auto it = s.shards.find(failed);
    if (it == s.shards.end() || !it->second->ClaimErrorReport()) continue;
    Status err = it->second->error();
    return Status(err.code(), "version " + std::to_string(failed) + " failed: " + err.message() +
                                  " (reported now; this snapshot of version " + std::to_string(version) +
                                  " was not taken)");
  }
}

Status SnapshotAdmission::WaitForRoom(Session& s, const CancelCheck& cancelled) {
  for (;;) {
    std::shared_ptr<ShardJob> oldest;
    std::size_t in_flight = 0;
    for (const auto& [ver, shard] : s.shards) {
      if (shard->level() >= Level::kPersisted || shard->failed()) continue;
      if (!oldest) oldest = shard;
      ++in_flight;
    }
    if (in_flight < kMaxInFlight) return Status::Ok();
    // One slice on the oldest, then count again: a newer shard may have finished first.
    WaitInSlices(std::chrono::steady_clock::now() + kWaitSlice, cancelled,
                 [&](auto slice_end) { return oldest->WaitFor(Level::kPersisted, slice_end); });
    if (cancelled && cancelled()) return Cancelled("client went away");
  }
}

Status SnapshotAdmission::CheckSealed(Session& s, std::uint64_t v) {
  if (!s.sealed || s.shards.empty()) return Status::Ok();
  const auto& [last, shard] = *s.shards.rbegin();
  if (!shard->sealed_registration() || shard->sealed() || shard->failed()) return Status::Ok();
  // The next snapshot would wait for room behind versions only this caller can seal.
  return FailedPrecondition("version " + std::to_string(last) + " is not sealed yet: call wait_snapshot(" +
                            std::to_string(last) + ") (which seals it) or abort_snapshot(" + std::to_string(last) +
                            ", why) before snapshot(" + std::to_string(v) + ")");
}

Status SnapshotAdmission::CheckVersion(Session& s, std::uint64_t v) {
  if (v <= s.last_version) {
    return FailedPrecondition("version " + std::to_string(v) + " is not higher than " +
                              std::to_string(s.last_version) +
                              ", the last version this registration snapshotted or restored");
  }
  const std::uint64_t latest = catalog_.Latest(s.job);
  if (v <= latest) {
    return FailedPrecondition("version " + std::to_string(v) + " is not higher than " +
                              std::to_string(latest) + ", the newest committed version of job '" + s.job +
                              "': to resume it, restore first (load(\"latest\") in ckpt.torch); to start afresh, use a new job "
                              "name; to roll back, restore an older version first");
  }
  return Status::Ok();
}

Status SnapshotAdmission::CheckTable(Session& s, std::uint64_t validated) {
  auto gen = ReadTableGeneration(
      [&](std::uint64_t off, void* dst, std::size_t len) { return s.table->ReadAt(off, dst, len); });
  if (!gen.ok()) return gen.status();
  if (gen.value() != validated) {
    return FailedPrecondition("descriptor table is at generation " + std::to_string(gen.value()) +
                              " but the client validated generation " + std::to_string(validated) +
                              "; register again");
  }
  if (gen.value() == s.table_generation) return Status::Ok();
  if (Status st = loader_.Load(s); !st.ok()) return st.With("re-reading descriptor table");
  if (s.device >= 0 && !s.events)
    return FailedPrecondition("the descriptor table now lists GPU tensors; register again");
  return Status::Ok();
}

Result<std::shared_ptr<ShardJob>> SnapshotAdmission::Admit(Session& s, const SnapshotRequestData& req,
                                                           const CancelCheck& cancelled) {
  const std::uint64_t v = req.version;
  if (Status st = ReportEarlierFailure(s, v); !st.ok()) return st;
  if (v == 0 || v > kMaxVersion) {
    return InvalidArgument("version " + std::to_string(v) + " is not in [1, " + std::to_string(kMaxVersion) +
                           "]");
  }
  if (Status st = CheckSealed(s, v); !st.ok()) return st;
  if (Status st = WaitForRoom(s, cancelled); !st.ok()) return st;
  if (Status st = CheckVersion(s, v); !st.ok()) return st;
  if (Status st = CheckTable(s, req.table_generation); !st.ok()) return st;

  std::vector<ShardItem> items;  // the blobs; the tensors come from s.tensors
  std::vector<ItemSource> sources;
  std::unordered_set<std::string_view> blob_names;
  std::uint64_t blob_bytes = 0;
  for (const auto& b : req.blobs) {
    if (std::string err = CheckItemName(b.name); !err.empty()) return InvalidArgument("blob: " + err);
    if (s.item_names.count(b.name) || !blob_names.insert(b.name).second) {
      return AlreadyExists("blob name " + QuoteName(b.name) + " is already used by another item");
    }
    if (b.for_rank && *b.for_rank >= s.world_size) {
      return InvalidArgument("blob " + QuoteName(b.name) + " is for rank " + std::to_string(*b.for_rank) +
                             ", which is not a rank of world size " + std::to_string(s.world_size));
    }
    blob_bytes += b.data->size();
    ShardItem item;
    item.name = b.name;
    item.for_rank = b.for_rank;
    item.kind = ItemKind::kBlob;
    item.dtype = DType::kU8;
    item.shape = {static_cast<std::int64_t>(b.data->size())};
    item.length = b.data->size();
    items.push_back(std::move(item));
    sources.push_back(ItemSource{nullptr, 0, b.data});
  }
  if (blob_bytes > max_blob_bytes_) {
    return ResourceExhausted("blobs total " + std::to_string(blob_bytes) + " bytes, over --max-blob-mib " +
                             std::to_string(max_blob_bytes_ >> 20));
  }
  ShardPlacement placement;
  if (s.events && s.device >= 0) {
    auto begun = s.events->Begin(v, req.trainer_event_slot);
    if (!begun.ok()) return begun.status().With("version " + std::to_string(v));
    placement.sync = std::move(begun).value();
  }
  placement.dir = local_ ? local_->VersionDir(s.job, v) : catalog_.VersionDir(s.job, v);
  placement.direct_io = local_ ? local_->direct_io() : persistent_direct_io_;
  placement.publish_level = local_ ? Level::kLocal : Level::kPersisted;
  placement.device = s.device;
  placement.copy_queue = s.id;
  placement.sealed = s.sealed;
  placement.verify = s.verify;
  ShardMeta meta{s.job, v, s.rank, s.world_size, s.registration};
  auto shard = std::make_shared<ShardJob>(std::move(meta), s.tensors, std::move(items), std::move(sources),
                                          std::move(placement));
  s.last_version = v;
  s.shards[v] = shard;
  std::vector<std::shared_ptr<ShardJob>> let_go;  // freed by the copy thread (ShardJob::Retire)
  while (s.shards.size() > kVersionsKept) {
    auto oldest = s.shards.begin();
    if (oldest->second->level() < Level::kPersisted && !oldest->second->failed()) break;
    let_go.push_back(std::move(oldest->second));
    s.shards.erase(oldest);
  }
  if (local_) {
    // Retention may not take the version from under a shard being written or queued for
    // promotion; the pin goes when the promoter has it, or when the shard fails first.
    local_->Pin(s.job, v);
    shard->MarkLocalPinned();
  }
  let_go.push_back(shards_.Add(shard));
  shard->Retire(std::move(let_go));
  engine_.Enqueue(shard);
  return shard;
}

}  // namespace ckpt
