// Client::Impl: the state behind a ckpt::Client (private to libckpt). It holds the
// registration (descriptor table, regions, GPU side), the session a daemon gave it and the
// channel it was made on, and it makes the session again when the daemon restarts.
//
// Where each job lives:
//   client/session.cc          the channel and session: drop, reconnect with backoff, and
//                              the Wait RPC that reconnects when the daemon went away
//   client/gpu_session.cc      the GPU side of a session: release words, draining the copies
//   client/registration.cc     building a registration and sending it (register_items)
//   client/lost_versions.h     the versions a restart lost, and their reports
//   client/client.cc           the public ckpt::Client methods
//
// Thread-safety: `mu` guards the registration and the connection. Register (and the
// reconnection after a daemon restart, which may take the whole reconnect budget) runs
// under it; the RPCs that may block for long (Wait, Snapshot, Restore) run outside it, on
// the stub and session they read under it (a Call), and compare the session epoch afterwards.
//
// Daemon restarts (see ckpt/client.h): a call that fails with UNAVAILABLE, or with
// NOT_FOUND from a daemon whose daemon_instance is not the session's, drops the session
// (its versions become lost versions, with the level each was known to have reached) and
// registers again on a fresh channel: a channel that saw its daemon die backs off its own
// reconnections for up to minutes, which the client's bounded backoff replaces.
#pragma once

#include <google/protobuf/repeated_ptr_field.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/client.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client/cuda_tensors.h"
#include "client/lost_versions.h"
#include "client/release_words.h"
#include "common/mutex.h"
#include "shm/descriptor_table.h"

namespace ckpt {

// The reconnect budget of `options`, else of $CKPT_RECONNECT_BUDGET_S, else 120 s. Throws
// INVALID_ARGUMENT when the variable is needed and is not a number of seconds.
std::chrono::milliseconds ReconnectBudget(const ClientOptions& options);

// A stub on a channel of its own (see the top of this file).
std::shared_ptr<v1::Checkpoint::Stub> NewStub(const std::string& socket_path);

// One Wait RPC. The caller notes its return (Impl::WaitReturned) before throwing.
grpc::Status CallWait(v1::Checkpoint::Stub& stub, const std::string& session, std::uint64_t version,
                      v1::Level level, std::chrono::milliseconds timeout, bool stream_ordered,
                      v1::WaitReply* rep, bool seal = false);

// Unregisters `session`, best effort: used where the client drops a session on its own.
void UnregisterQuietly(v1::Checkpoint::Stub& stub, const std::string& session);

// Hidden: a nested class takes the visibility of the exported Client, and its members are
// libckpt's own (ckpt/export.h).
struct CKPT_HIDDEN Client::Impl {
  std::string socket_path;
  std::chrono::milliseconds reconnect_budget{0};
  std::chrono::milliseconds initial_backoff{0};
  std::chrono::milliseconds max_backoff{0};

  Mutex mu;  // guards the registration and the connection
  std::shared_ptr<v1::Checkpoint::Stub> stub GUARDED_BY(mu);
  std::string session GUARDED_BY(mu);
  std::string instance GUARDED_BY(mu);  // daemon_instance of the session's daemon ("" if it has none)
  // Sessions made so far: a call made on a session compares it afterwards, to tell whether
  // what it learnt still applies.
  std::uint64_t epoch GUARDED_BY(mu) = 0;
  // The registration a restart makes again.
  std::string job GUARDED_BY(mu);
  std::uint32_t rank GUARDED_BY(mu) = 0;
  std::uint32_t world_size GUARDED_BY(mu) = 0;
  RegisterOptions options GUARDED_BY(mu);
  // The daemon went away and no session has been made since: the next call reconnects.
  bool daemon_lost GUARDED_BY(mu) = false;
  // A daemon accepted a registration of this client once: only then is a daemon waited for.
  bool served GUARDED_BY(mu) = false;
  // Versions snapshotted in this session: the level each is known to have reached (kNone:
  // not yet known to be captured).
  std::map<std::uint64_t, Level> versions GUARDED_BY(mu);
  // Versions of sessions a daemon restart ended.
  LostVersions lost GUARDED_BY(mu);

  std::optional<DescriptorTable> table GUARDED_BY(mu);
  struct Registered {
    std::shared_ptr<SharedRegion> region;
    std::uint64_t generation;
    std::size_t size;
    std::string item;
  };
  std::vector<Registered> registered GUARDED_BY(mu);
  // The items' global layouts, sent with every registration (a reconnection's too).
  google::protobuf::RepeatedPtrField<v1::ItemLayout> layouts GUARDED_BY(mu);
  // The GPU side of the registration; null when it has no GPU tensors. Shared so that a
  // call in flight keeps it alive across a concurrent re-registration.
  std::shared_ptr<CudaTensors> cuda GUARDED_BY(mu);
  TrainerSlotBook trainer_slots GUARDED_BY(mu);
  std::uint64_t last_snapshot GUARDED_BY(mu) = 0;  // newest version passed to snapshot() in this session
  // The stall of the last wait_snapshot, in ns, not yet sent to the daemon (-1: none); the
  // next snapshot reports it (ckptd_snapshot_stall_seconds). An atomic, so the wait that
  // measured it takes no lock after its clock stopped.
  std::atomic<std::int64_t> unreported_stall_ns{-1};

  // The release words (client/release_words.h), made at the first GPU registration and kept
  // for the client's life: their floor must only grow across sessions and daemons.
  std::shared_ptr<ReleaseWords> words GUARDED_BY(mu);
  std::shared_ptr<const void> words_mapping GUARDED_BY(mu);  // their CUDA registration; null: not made
  std::string words_unused GUARDED_BY(mu);                   // why the session waits on events instead
  bool words_in_use GUARDED_BY(mu) = false;                  // this session's stream waits use them
  // Releases the words when the daemon process of the session exits.
  std::unique_ptr<DaemonWatch> watch GUARDED_BY(mu);

  ~Impl();

  // What a call outside the lock uses: read together under it.
  struct Call {
    std::shared_ptr<v1::Checkpoint::Stub> stub;
    std::string session;
    std::string instance;
    std::uint64_t epoch = 0;
    std::shared_ptr<CudaTensors> cuda;
    std::uint64_t last_snapshot = 0;
    std::shared_ptr<ReleaseWords> words;  // set when the session's stream waits use them
  };

  Call CallLocked() REQUIRES(mu) {
    return Call{stub, session, instance, epoch, cuda, last_snapshot, words_in_use ? words : nullptr};
  }

  // --- The registration (client/registration.cc).

  // The registration request of the current table, regions and GPU side, for `job`, `rank`
  // and `world_size` (a reconnection passes the session's own).
  v1::RegisterRequest RequestLocked(const std::string& job, std::uint32_t rank, std::uint32_t world_size)
      REQUIRES(mu);
  // Throws FAILED_PRECONDITION if a registered region was resized (or shrunk by someone
  // else) since registration: the daemon would copy memory that no longer holds the tensor.
  void CheckRegionsLocked() REQUIRES(mu);

  // --- The GPU side of a session (client/gpu_session.cc).

  // Before a GPU registration: makes the release words and maps them for the device once;
  // on failure the registration goes on with events only (words_unused says why).
  void PrepareReleaseWordsLocked(CudaTensors& gpu) REQUIRES(mu);
  // The release words of a new or renewed registration.
  void AddReleaseWordsLocked(v1::CudaSession* c) REQUIRES(mu);
  // A daemon accepted a GPU registration: its stream-ordered waits use the release words
  // only if it writes them and its process can be watched from here.
  void UseReleaseWordsLocked(const v1::RegisterReply& rep) REQUIRES(mu);
  // The device of session `c` cannot wait on memory: its waits use the daemon's events.
  void ReleaseWordsUnsupported(const Call& c) EXCLUDES(mu);
  // Before a GPU session ends: the daemon may still be about to wait on the trainer's
  // events or copy from the tensors of its newest version (and so, in order, of every older
  // one). Waits until that version is captured or failed, so that the trainer may then
  // destroy its events and free the tensors.
  void DrainGpuLocked() REQUIRES(mu);

  // --- The session and its reconnection (client/session.cc).

  // The registration ends (unregistered, or replaced by a new session).
  void EndSessionLocked() REQUIRES(mu);
  // Whether the call that returned `s` on `c` found the daemon gone: the socket refused or
  // broke, or the daemon does not know the session and is another process than the one
  // that made it. Asks the daemon (Status) only for NOT_FOUND.
  static bool DaemonGone(const grpc::Status& s, const Call& c);
  // The daemon went away: the session ends with it, and its versions become lost versions
  // (lost unless committed); the registration (table, regions, GPU side) stays for the next.
  void DropSessionLocked() REQUIRES(mu);
  // Registers the same table, regions and GPU side again, with a daemon that went away
  // (`cause` says how the client found out), retrying with backoff within the budget.
  // Throws after the budget (UNAVAILABLE), or if the daemon refuses the registration.
  v1::RegisterReply RecoverLocked(const std::string& cause) REQUIRES(mu);
  // The daemon accepted a registration made after it went away.
  void InstallSessionLocked(const std::shared_ptr<v1::Checkpoint::Stub>& fresh, const v1::RegisterReply& rep)
      REQUIRES(mu);
  // The session, reconnected first if the daemon went away; throws if not registered.
  Call Current(const std::string& what) EXCLUDES(mu);
  // `what`: the call that needs the session, for messages.
  void EnsureSessionLocked(const std::string& what) REQUIRES(mu);
  // A call on `c` found the daemon gone: registers again unless another thread already did.
  void Recover(const Call& c, const std::string& cause) EXCLUDES(mu);

  // --- What the session's calls tell of its versions (client/session.cc).

  // A Wait RPC on `version`, made on `c`, returned `s` (`rep`): notes what it tells.
  void WaitReturned(const Call& c, std::uint64_t version, const grpc::Status& s, const v1::WaitReply& rep)
      EXCLUDES(mu);
  // The snapshot of `version` was taken in the session of `c`.
  void SnapshotTaken(const Call& c, std::uint64_t version) EXCLUDES(mu);
  // Brings the lost versions up to what the daemon finds on storage. Returns a note for
  // messages: the newest committed version, or why the daemon could not be asked.
  std::string RefreshLostLocked() REQUIRES(mu);
  // Whether the restarted daemon finds `version` committed; if so it counts as a lost
  // version that committed (waits on it return).
  bool CommittedAfterRestart(std::uint64_t version) EXCLUDES(mu);
  // A wait for `version` at `level`: if the version was lost to a restart, answers it from
  // what is known (true: reached) or throws its DaemonRestartedError; false if not lost.
  bool AnswerLost(std::uint64_t version, Level level) EXCLUDES(mu);
  // Keeps a wait_snapshot's stall for the next snapshot to report; returns it.
  std::chrono::nanoseconds NoteStall(std::chrono::nanoseconds stall) {
    unreported_stall_ns.store(static_cast<std::int64_t>(stall.count()), std::memory_order_relaxed);
    return stall;
  }
  // A wait for `version` at `level`, stream-ordered if asked and possible (*ordered says
  // whether it was), on the current session, reconnecting when the daemon went away meanwhile.
  // Returns false if answered from the lost versions (then `rep` is untouched), true if by
  // the daemon on session *used.
  bool Wait(std::uint64_t version, Level level, std::chrono::milliseconds timeout, bool stream_ordered,
            const std::string& what, Call* used, bool* ordered, v1::WaitReply* rep, bool seal = false)
      EXCLUDES(mu);
};

}  // namespace ckpt
