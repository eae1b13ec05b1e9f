#include "daemon/session/session_table.h"

#include <spdlog/spdlog.h>

namespace ckpt {

SessionTable::SessionTable(ShardRegistry& shards, DeviceBackend* backend, std::function<void()> on_reap,
                           std::uint32_t max_sessions_per_uid, ItemBudget& items)
    : shards_(shards),
      backend_(backend),
      on_reap_(std::move(on_reap)),
      max_sessions_per_uid_(max_sessions_per_uid),
      items_(items) {}

void SessionTable::StartReaper() {
  reaper_ = std::thread([this] { ReapLoop(); });
}

void SessionTable::Stop() {
  bool first = false;
  {
    MutexLock lock(reap_mu_);
    first = !stopping_;
    stopping_ = true;
  }
  reap_cv_.SignalAll();
  if (!reaper_.joinable()) return;
  reaper_.join();
  if (first) ReapExited();
}

Result<std::shared_ptr<Session>> SessionTable::Find(const std::string& id, uid_t uid) const {
  MutexLock lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || !it->second->open) {
    return NotFound("unknown or closed session '" + id.substr(0, 64) + "' (register first)");
  }
  if (it->second->peer.uid != uid) {
    return PermissionDenied("session of job '" + it->second->job + "' rank " +
                            std::to_string(it->second->rank) + " belongs to uid " +
                            std::to_string(it->second->peer.uid) + ", not to uid " + std::to_string(uid));
  }
  return it->second;
}

Status SessionTable::Add(const std::shared_ptr<Session>& s, std::shared_ptr<Session>* replaced) {
  MutexLock lock(mu_);
  for (const auto& [id, other] : by_id_) {
    if (other->job == s->job && other->world_size != s->world_size && !other->TrainerExited()) {
      return InvalidArgument("job '" + s->job + "' runs with world size " +
                             std::to_string(other->world_size) + " (rank " + std::to_string(other->rank) +
                             "), not " + std::to_string(s->world_size));
    }
  }
  auto key = std::make_pair(s->job, s->rank);
  std::shared_ptr<Session> old;
  if (auto it = rank_owner_.find(key); it != rank_owner_.end()) {
    old = by_id_.at(it->second);
    if (!old->TrainerExited()) {
      return AlreadyExists("rank " + std::to_string(s->rank) + " of job '" + s->job +
                           "' is already registered by pid " + std::to_string(old->peer.pid) +
                           ", which is still running");
    }
  }
  if (max_sessions_per_uid_ != 0) {
    std::uint32_t held = 0;
    for (const auto& [id, other] : by_id_) held += other->peer.uid == s->peer.uid && other != old;
    if (held >= max_sessions_per_uid_) {
      return ResourceExhausted("uid " + std::to_string(s->peer.uid) + " has " + std::to_string(held) +
                               " sessions open, the most --max-sessions-per-uid allows (" +
                               std::to_string(max_sessions_per_uid_) + "); unregister one first");
    }
  }
  *replaced = std::move(old);
  by_id_[s->id] = s;
  rank_owner_[key] = s->id;
  return Status::Ok();
}

void SessionTable::Close(const std::shared_ptr<Session>& s, bool trainer_gone) {
  if (!s->open.exchange(false)) return;
  items_.Release(s->id);
  {
    MutexLock lock(mu_);
    by_id_.erase(s->id);
    auto key = std::make_pair(s->job, s->rank);
    if (auto it = rank_owner_.find(key); it != rank_owner_.end() && it->second == s->id)
      rank_owner_.erase(it);
  }
  // A sealed registration's versions count only once the client vouched for them: one it
  // could no longer seal is dropped, never published.
  if (abort_) {
    for (const auto& shard : shards_.Unsealed(s->job, s->id)) {
      const std::string v = std::to_string(shard->meta().version);
      abort_(shard, Aborted(trainer_gone ? "trainer pid " + std::to_string(s->peer.pid) +
                                               " exited before it sealed version " + v +
                                               " (the wait that vouches for its memory never came)"
                                         : "the registration ended before version " + v + " was sealed"));
    }
  }
  if (!trainer_gone) {
    spdlog::info("job {} rank {}: unregistered", s->job, s->rank);
    return;
  }
  // The trainer cannot clean up its shared memory any more; in-flight copies keep their
  // descriptors, so removing the names loses nothing.
  {
    MutexLock lock(s->regions_mu);
    for (const auto& r : s->regions) r->UnlinkIfOrphaned();
  }
  s->table->UnlinkIfOrphaned();
  if (s->device >= 0) {
    // Its GPU versions not yet captured are given up: their copies wait on events of a
    // context that is gone (which may never fire), and an event that fires at teardown
    // would not mean the update was complete.
    for (const auto& shard : shards_.Uncaptured(s->job, s->id)) {
      shard->Fail(FailedPrecondition("trainer pid " + std::to_string(s->peer.pid) +
                                     " exited before version " + std::to_string(shard->meta().version) +
                                     " was copied out of its GPU memory; the version is abandoned"));
    }
  }
  // Its CUDA allocations are closed now, or when the copies still using them end.
  if (backend_) backend_->ReleaseClient(s->peer.pid);
  spdlog::info("job {} rank {}: trainer pid {} exited; session closed", s->job, s->rank, s->peer.pid);
}

void SessionTable::Unregister(const std::shared_ptr<Session>& s, const CancelCheck& cancelled) {
  Close(s, /*trainer_gone=*/false);
  if (s->device < 0) return;  // shared memory: the descriptors go with the session
  if (Status st = AwaitCaptured(*s, cancelled); !st.ok()) {
    // The caller is gone; the copies keep what they use, and let go of it when they end.
    spdlog::warn("job {} rank {}: unregistered while versions were still being copied: {}", s->job, s->rank,
                 st.message());
  }
  {
    // After any call of the session still running (it may be using the regions).
    MutexLock lock(s->mu);
    s->items.clear();
    s->item_regions.clear();
    s->tensors.reset();
    s->item_names.clear();
    s->tensor_bytes = 0;
  }
  {
    MutexLock lock(s->regions_mu);
    s->regions.clear();
  }
  AwaitReleases(*s, "unregister");
}

Status SessionTable::AwaitCaptured(const Session& s, const CancelCheck& cancelled) const {
  for (const auto& shard : shards_.Uncaptured(s.job, s.id)) {
    Status st = WaitInSlices(std::chrono::steady_clock::time_point::max(), cancelled,
                             [&](auto slice_end) { return shard->WaitFor(Level::kCaptured, slice_end); });
    if (st.code() == StatusCode::kCancelled) return st;  // a failed version is settled too
  }
  return Status::Ok();
}

void SessionTable::AwaitReleases(const Session& s, const char* why) const {
  if (!backend_) return;
  if (Status st = backend_->AwaitReleases(std::chrono::steady_clock::now() + kReleaseWait); !st.ok()) {
    spdlog::warn("job {} rank {} ({}): GPU memory of the trainer may still be mapped: {}", s.job, s.rank, why,
                 st.message());
  }
}

void SessionTable::NoteFailure(const std::string& job, std::uint32_t rank, std::uint64_t version) {
  std::shared_ptr<Session> owner;
  {
    MutexLock lock(mu_);
    auto it = rank_owner_.find({job, rank});
    if (it == rank_owner_.end()) return;
    owner = by_id_.at(it->second);
  }
  MutexLock lock(owner->failures_mu);
  owner->unreported_failures.insert(version);
}

std::vector<std::shared_ptr<Session>> SessionTable::All() const {
  MutexLock lock(mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, s] : by_id_) out.push_back(s);
  return out;
}

void SessionTable::ReapLoop() {
  for (;;) {
    {
      MutexLock lock(reap_mu_);
      if (stopping_) return;
      reap_cv_.WaitFor(reap_mu_, std::chrono::milliseconds(250));
      if (stopping_) return;
    }
    ReapExited();
    if (on_reap_) on_reap_();
  }
}

void SessionTable::ReapExited() {
  std::vector<std::shared_ptr<Session>> gone;
  for (const auto& s : All()) {
    if (s->TrainerExited()) gone.push_back(s);
  }
  for (const auto& s : gone) Close(s, /*trainer_gone=*/true);
}

}  // namespace ckpt
