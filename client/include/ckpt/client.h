// libckpt: the trainer's thin client of ckptd.
//
// A trainer keeps its state in shared-memory regions (ckpt::SharedRegion), registers the
// tensors that live there once, and then per iteration calls snapshot(v) after the update
// and wait_snapshot(v) before the next update. Bulk data never crosses the socket: the
// daemon reads the regions directly, lazily, while the trainer computes.
//
//   auto region = ckpt::SharedRegion::create(bytes);
//   ckpt::Client client = ckpt::Client::connect();          // default socket
//   client.register_items("job", rank, world, {{"w", ckpt::DType::kF32, {n}, region, 0}});
//   for (v = 1..) { update(); client.snapshot(v); compute(); client.wait_snapshot(v); }
//
// GPU tensors (built with CUDA): set TensorItem::cuda_ptr instead of a region. The daemon
// imports the allocation through CUDA IPC and copies it on its own streams after an
// interprocess event the client records at snapshot(v) on the given stream:
//
//   client.register_items("job", rank, world, {{"w", ckpt::DType::kBF16, {n}, nullptr, 0, d_w}});
//   for (v = 1..) {
//     update<<<..., stream>>>(); client.snapshot(v, {}, stream);
//     forward_backward(stream);
//     client.wait_snapshot_on_stream(v, stream);   // the optimizer queues behind the copies
//   }
//
// Thread-safety: every Client method may be called from any thread; calls that change the
// registration are serialised. Errors throw ckpt::Error, whose what() carries the daemon's
// message and code() its gRPC status code.
//
// A daemon restart (a crash and systemd's Restart=on-failure, or a stop and start) does not
// end the registration. The call that finds the daemon gone (the socket refuses or breaks,
// or the daemon no longer knows the session and reports another daemon_instance) tries to
// reach it again, with exponential backoff up to ClientOptions::reconnect_budget, and
// registers the same descriptor table, regions and, for GPU tensors, CUDA IPC handles and
// trainer events again, under the same job, rank and world size; nothing of the trainer's
// state is copied. Then:
//  - snapshot, restore and register_items simply go on against the new daemon;
//  - a version snapshotted before the restart and not yet known committed is resolved
//    against what the new daemon finds on storage (List): a wait at a level the version
//    had reached before the crash, or that the new daemon's tiers show for this rank,
//    returns; otherwise it throws DaemonRestartedError, "daemon restarted; version N was
//    not captured" (or "not made durable", "not committed"), at once, never blocking;
//  - each such lost version is reported once: the first error about the restart names
//    every lost version not yet reported, and a snapshot whose client still holds
//    unreported lost versions throws that report instead of being taken ("reported now;
//    this snapshot of version N was not taken"), as the daemon does for background
//    failures. The next snapshot is taken.
// After the budget, the call fails with code UNAVAILABLE, "ckptd at PATH did not come back
// within S s"; the next call tries again.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/dtype.h"
#include "ckpt/export.h"
#include "ckpt/level.h"

namespace ckpt {

class CKPT_API Error : public std::runtime_error {
 public:
  // `code` is the gRPC status code (grpc::StatusCode) of the failed call.
  Error(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// Versions lost to a daemon restart (see above); code() is ABORTED (10).
class CKPT_API DaemonRestartedError : public Error {
 public:
  DaemonRestartedError(const std::string& message, std::vector<std::uint64_t> versions)
      : Error(kAborted, message), versions_(std::move(versions)) {}
  // Every version the message names as lost, oldest first.
  const std::vector<std::uint64_t>& versions() const { return versions_; }

  static constexpr int kAborted = 10;

 private:
  std::vector<std::uint64_t> versions_;
};

// A version aborted because the trainer's memory changed between snapshot(v) and the end of
// its copy (a torn snapshot), found by the daemon's verification or reported by the client
// (abort_snapshot); code() is ABORTED (10). The version is never committed; the previous
// committed version is untouched.
class CKPT_API TornSnapshotError : public Error {
 public:
  TornSnapshotError(const std::string& message, std::uint64_t version)
      : Error(DaemonRestartedError::kAborted, message), version_(version) {}
  std::uint64_t version() const { return version_; }

 private:
  std::uint64_t version_;
};

// How the versions of a registration become final. The contract of every registration: the
// registered memory of version v must not change from snapshot(v) until wait_snapshot(v)
// (or wait_snapshot_on_stream(v), for work queued after it) returns; the update that the
// wait protects (the optimizer step) comes after it. These options make the daemon enforce
// what it can of that contract instead of trusting it.
struct RegisterOptions {
  // A version is published (its final file name, the memory tier, peers) and can commit only
  // once this client sealed it: wait_snapshot(v) / wait_snapshot_on_stream(v) with `seal`
  // (the default), the client's word that nothing changed, or abort_snapshot(v) to drop it.
  // A version never sealed (the trainer died, or unregistered, before its wait) is dropped;
  // the next snapshot after v is refused while v is neither sealed nor aborted.
  bool sealed = false;
  // Implies sealed. The daemon hashes every piece of host memory it copies, and at the
  // sealing wait reads the regions again and compares: a piece that changed aborts the
  // version, and the wait throws TornSnapshotError naming the item and its bytes. Costs one
  // more read of the state at each wait (docs/DESIGN-NOTES.md gives the figures). GPU
  // tensors are not read again (their copies are ordered after the trainer's stream).
  // ckptd --verify-snapshots turns it on for every registration.
  bool verify = false;
};

struct ClientOptions {
  // How long one call keeps trying to reach a daemon that went away (restarting) before it
  // fails. Unset: $CKPT_RECONNECT_BUDGET_S (seconds, may be fractional), else 120 s. Zero:
  // one attempt, no waiting (the call fails at once if the daemon is not back).
  std::optional<std::chrono::milliseconds> reconnect_budget;
  // Pause after the first failed attempt; it doubles after each one, up to the maximum.
  std::chrono::milliseconds reconnect_initial_backoff{50};
  std::chrono::milliseconds reconnect_max_backoff{2000};
};

// Shared memory the trainer owns and the daemon may read and write. Created 0600; its
// name is removed when the last SharedRegion handle to it goes away, or when the process that
// created it exits (normally: exit() or the end of main) with handles still held.
class CKPT_API SharedRegion {
 public:
  // Creates a region of `bytes` (zero-filled). Throws ckpt::Error on failure.
  static std::shared_ptr<SharedRegion> create(std::size_t bytes, const std::string& name = "");
  virtual ~SharedRegion() = default;
  virtual void* data() const = 0;
  virtual std::size_t size() const = 0;
  virtual const std::string& name() const = 0;
  // Changes the size; items registered in this region become stale until registered again.
  virtual void resize(std::size_t bytes) = 0;
  // Incremented by resize(); used to detect stale registrations.
  virtual std::uint64_t generation() const = 0;
};

// Where an item sits in a global tensor, for a restore at another world size and for
// `ckptctl export`. Unset (TensorItem::layout): the item is rank-private, and restores only to
// the same rank at the same world size. Checked at register_items: as many offsets and
// global dimensions as the item has dimensions, offsets >= 0, offsets + shape <= global
// shape (a bad layout is INVALID_ARGUMENT naming the item). Every rank that declares a piece
// of one global tensor declares it with the same dtype and global shape, and the pieces of
// all ranks cover it exactly once (else the version's commit fails, naming the tensor).
struct Layout {
  // Empty: the item's own name.
  std::string global_name;
  // The whole tensor's shape (replicated: may be empty = the item's shape).
  std::vector<std::int64_t> global_shape;
  // The box's first index per dimension; its extent is the item's shape.
  std::vector<std::int64_t> offsets;
  // Every rank that declares it holds the whole tensor; one copy is enough.
  bool replicated = false;
};

// One tensor: `shape` elements of `dtype`, packed, either at `offset` in `region` (host
// memory) or at `cuda_ptr` (GPU memory; `region` null, `offset` unused). A GPU tensor must
// live in memory CUDA IPC can export (cudaMalloc, PyTorch's default caching allocator), not
// in cuMem/VMM allocations (PyTorch expandable_segments) nor in managed memory; all GPU
// tensors of one registration must be on one device.
struct TensorItem {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::int64_t> shape;
  std::shared_ptr<SharedRegion> region;
  std::uint64_t offset = 0;
  const void* cuda_ptr = nullptr;
  std::optional<Layout> layout = std::nullopt;
};

// Bytes stored with a version (pickled optimizer groups, RNG state, data position).
struct Blob {
  std::string name;
  std::string data;
  // At a restore by another world size: unset = every rank gets this blob; set = only that
  // rank (below the world size, else snapshot() fails with INVALID_ARGUMENT).
  std::optional<std::uint32_t> for_rank = std::nullopt;
  std::uint32_t from_rank = 0;  // in RestoreResult: the rank that wrote it
};

struct RestoreResult {
  std::uint64_t version = 0;
  // Where the daemon read it: "memory", "local", "peer" (a replica in another daemon's memory,
  // --replicas) or "persistent"; a restore at another world size: the slowest one read.
  std::string tier;
  std::vector<Blob> blobs;
  std::uint64_t tensor_bytes = 0;
  std::uint32_t world_size = 0;  // that wrote the version
  bool resharded = false;        // filled from the pieces of other ranks or another world size
  // The version was not committed yet: every rank's shard had been replicated to peers'
  // memory (ckptd --replicas), which makes a version restorable before its commit, and a
  // restore of the newest version took it (`ckptctl ls` shows such a version as
  // `replicated`: docs/ops/ckptctl.md).
  bool uncommitted = false;
};

struct Registration {
  std::uint32_t item_count = 0;
  std::uint64_t tensor_bytes = 0;
  std::uint64_t latest_committed = 0;  // 0 if the job has no committed version
  // In force for this registration (the daemon's --verify-snapshots may turn both on).
  bool sealed = false;
  bool verify = false;
};

// What `ckptctl status` shows, as JSON text (the daemon's StatusReply).
struct DaemonStatus {
  std::string json;
};

class CKPT_API Client {
 public:
  // Connects to the daemon at `socket_path` (default: $CKPTD_SOCKET if set and not empty,
  // else /run/ckptd/ckptd.sock, the node daemon's). Does not block; the
  // first call fails with a clear error if no daemon serves there (the first registration
  // does not wait for a daemon: only one that served this client is waited for). Throws if
  // $CKPT_RECONNECT_BUDGET_S is needed and is not a number of seconds.
  static Client connect(const std::string& socket_path = "", const ClientOptions& options = {});
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();  // unregisters if registered

  // Registers (or, called again, re-registers) this trainer's tensors.
  Registration register_items(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                              const std::vector<TensorItem>& items, const RegisterOptions& options = {});
  // Asks the daemon to capture version `version` and returns at once. Throws if a registered
  // region changed since registration, or a GPU tensor's allocation was freed or moved
  // (register again), or if an earlier version failed in the background (the error says
  // which and why).
  // With GPU tensors, the version is the state once the work queued so far on `cuda_stream`
  // (a cudaStream_t; nullptr: the legacy default stream) has run: the client records an
  // interprocess event there and the daemon's copies wait on it.
  void snapshot(std::uint64_t version, const std::vector<Blob>& blobs = {}, void* cuda_stream = nullptr);
  // Blocks until every byte of `version` is out of trainer memory; returns the stall. For a
  // sealed registration (RegisterOptions) it then seals the version unless `seal` is false
  // (verifying it first in verify mode: TornSnapshotError if its memory changed).
  std::chrono::nanoseconds wait_snapshot(std::uint64_t version,
                                         std::chrono::milliseconds timeout = std::chrono::milliseconds(0),
                                         bool seal = true);
  // Sealed registrations: drops `version` (never published nor committed; status and
  // `ckptctl ls` show it aborted with `reason`), for a trainer that found its memory changed
  // before the copy ended. FAILED_PRECONDITION for a version sealed already or of another
  // registration.
  void abort_snapshot(std::uint64_t version, const std::string& reason);
  // The stream-ordered form, for GPU registrations: makes `cuda_stream` (a cudaStream_t)
  // wait until every byte of `version` is copied, so work queued there afterwards (the
  // optimizer) runs after the copies while the CPU goes on. The host blocks only until the
  // daemon has queued the copies (longer only when its pool is full). For a host-only
  // registration, or a version older than the last snapshot, it is wait_snapshot. Returns
  // the time the host blocked. The stream waits on a release word where the daemon and the
  // device allow (see stream_wait()): should the daemon die before the copies run, the
  // client releases the stream itself, and its next call reports the version lost.
  // Seals the version (sealed registrations) unless `seal` is false.
  std::chrono::nanoseconds wait_snapshot_on_stream(std::uint64_t version, void* cuda_stream, bool seal = true);
  // Sets the trainer's stall that the next snapshot reports to the daemon (its stall metric),
  // in place of the time the last wait blocked: for a trainer whose waits run on a thread of
  // their own (ckpt.torch's worker), where the trainer blocked for less or not at all.
  void report_stall(std::chrono::nanoseconds stall);
  // Blocks until `version` reaches `level` (default: committed across all ranks). For a sealed
  // registration it seals the version first, as wait_snapshot does (it implies that wait).
  void wait_durable(std::uint64_t version, Level level = Level::kCommitted,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Fills the registered regions from `version` (nullopt: the newest committed) and returns
  // the version's blobs. GPU tensors are filled by the daemon, which copies into their
  // allocations and synchronises its streams before it replies: once restore returns, the
  // data is in device memory, visible to work queued afterwards on any stream. Checksums
  // are verified before any byte is written: a DATA_LOSS error leaves the regions as they
  // were (its message says "nothing was written to the registered regions").
  RestoreResult restore(std::optional<std::uint64_t> version = std::nullopt);
  // The daemon's status as JSON.
  DaemonStatus status();
  // Ends the registration (in-flight versions still complete). With GPU tensors it first
  // waits until the newest version is copied out: free GPU tensors only after this (or a
  // wait_snapshot of the newest version) returned.
  void unregister();
  // unregister(), saying whether the job is over and will not restart (`job_finished`):
  // once no trainer of it is left on the daemon (any one of them may say it), the daemon
  // drops its memory images of the job's committed versions and the replicas at its peers
  // (files stay). Without it (and always when a trainer crashes) they stay for the job's
  // restart; `ckptctl finish --job J` lets them go later.
  void unregister(bool job_finished);

  const std::string& socket_path() const;
  // The reconnection budget in force (options, environment or default).
  std::chrono::milliseconds reconnect_budget() const;
  // How wait_snapshot_on_stream makes a stream wait in the current GPU session: "release
  // words" (a word in this process's memory that the daemon's stream writes after the
  // copies and that the client writes itself if the daemon process exits, so that the
  // stream never waits on a dead daemon), or "daemon events: WHY" (the daemon's
  // interprocess event, which a daemon dying before its copies run leaves unfired), or
  // "none: ..." without a GPU registration.
  std::string stream_wait() const;

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckpt
