// SessionTable: the live sessions of this daemon, by id and by (job, rank), and the reaper
// that closes the session of a trainer that exited. In: sessions made by Register. Out: the
// session a call names (checked against the caller's uid), the owner of a rank (to tell it
// of a failed version), the list for status. Closing a session whose trainer is gone also
// cleans up after it: its shared-memory names are removed, its GPU versions not yet captured
// are abandoned (their copies wait on events of a context that is gone), and the device
// backend closes its CUDA allocations. Thread-safe.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/device_copier.h"
#include "common/cancellable_wait.h"
#include "common/mutex.h"
#include "common/status.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/session/session.h"
#include "daemon/session/uid_limits.h"

namespace ckpt {

class SessionTable {
 public:
  // `backend` may be null. `on_reap` runs after each pass of the reaper (every 250 ms).
  // `max_sessions_per_uid` (0: none) bounds the open sessions of one uid; a closed session
  // gives its items back to `items`.
  SessionTable(ShardRegistry& shards, DeviceBackend* backend, std::function<void()> on_reap,
               std::uint32_t max_sessions_per_uid, ItemBudget& items);
  ~SessionTable() { Stop(); }

  void StartReaper();
  // Stops the reaper after one last pass over the sessions (the first call after
  // StartReaper only): a trainer that died since the previous pass has its shm names
  // removed, which no one would remove once this daemon is gone.
  void Stop() EXCLUDES(reap_mu_);

  // The open session `id`, if it belongs to `uid`.
  Result<std::shared_ptr<Session>> Find(const std::string& id, uid_t uid) const EXCLUDES(mu_);
  // Publishes a new session of (job, rank). Refused while another live trainer holds the
  // rank or runs the job at another world size, and when its uid holds
  // --max-sessions-per-uid sessions (ResourceExhausted). A session of the rank whose trainer
  // exited is returned in *replaced, for the caller to close (it does not count).
  Status Add(const std::shared_ptr<Session>& s, std::shared_ptr<Session>* replaced) EXCLUDES(mu_);
  // Closes the session (once): Unregister, a failed Register, or its trainer exited
  // (`trainer_gone`: the clean-up above).
  void Close(const std::shared_ptr<Session>& s, bool trainer_gone) EXCLUDES(mu_);
  // The trainer unregisters: closes the session, waits until none of its GPU versions is
  // still being copied, lets go of every region it imported and waits (at most
  // kReleaseWait) for the device backend to close them. On return the trainer may free its
  // tensors: the daemon maps none of them, except where a close had to be put off (logged).
  void Unregister(const std::shared_ptr<Session>& s, const CancelCheck& cancelled) EXCLUDES(mu_);
  // Blocks until no GPU version of `s` is still being copied out of its trainer's memory
  // (each is captured or failed); kCancelled if `cancelled` turns true first.
  Status AwaitCaptured(const Session& s, const CancelCheck& cancelled) const;
  // Waits (at most kReleaseWait) until the device backend has closed what the daemon let go
  // of; a close that is put off or does not return is logged, not an error of the call.
  void AwaitReleases(const Session& s, const char* why) const;
  static constexpr std::chrono::seconds kReleaseWait{2};
  // Version `version` of (job, rank) failed: its current session reports it on its next
  // Snapshot call.
  void NoteFailure(const std::string& job, std::uint32_t rank, std::uint64_t version) EXCLUDES(mu_);
  std::vector<std::shared_ptr<Session>> All() const EXCLUDES(mu_);
  // How a closed session's versions that were never sealed are aborted (set before the
  // first session: the daemon's ShardAborter).
  using Aborter = std::function<void(const std::shared_ptr<ShardJob>&, const Status&)>;
  void SetAborter(Aborter abort) { abort_ = std::move(abort); }

 private:
  void ReapLoop() EXCLUDES(reap_mu_);
  // Closes the sessions whose trainer exited (the clean-up of Close).
  void ReapExited() EXCLUDES(mu_);

  ShardRegistry& shards_;
  DeviceBackend* backend_;
  const std::function<void()> on_reap_;
  Aborter abort_;
  const std::uint32_t max_sessions_per_uid_;
  ItemBudget& items_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::uint32_t>, std::string> rank_owner_
      GUARDED_BY(mu_);  // (job, rank) -> id
  Mutex reap_mu_;
  CondVar reap_cv_;
  bool stopping_ GUARDED_BY(reap_mu_) = false;
  std::thread reaper_;
};

}  // namespace ckpt
