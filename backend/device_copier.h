// The device copier: how the snapshot engine moves bytes out of imported regions, and
// what a GPU backend adds to the daemon.
//
// A CopyLane is one ordered queue of copies: a CUDA stream of the daemon, or, for host
// memory, the calling thread (HostCopyLane, where a copy is done before CopyOut returns).
// The snapshot engine queues a chunk's pieces on a lane, ends the chunk (a ticket), and
// waits for the ticket before it hands the chunk to the flush engine. The restore engine
// queues host-to-device copies (CopyIn) out of verified pool chunks the same way. The same
// engine code runs for shm regions (host lanes) and CUDA regions (stream lanes); CPU tests
// drive it with lanes whose copies complete later, on another thread.
//
// A VersionSync orders the copies of one version against the trainer on the device: each
// lane first waits for the trainer's interprocess event of the version (Gate), and after
// the last copy the daemon records its own completion event (Signal), on which a
// stream-ordered wait_snapshot makes a trainer stream wait.
//
// DeviceBackend is what the daemon needs from a GPU runtime (the CUDA one lives in cuda/;
// the daemon runs without one, refusing device regions with a clear error).
//
// Thread-safety: a CopyLane is used by one thread at a time. VersionSync, SessionEvents and
// DeviceBackend are thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/region_importer.h"
#include "common/status.h"

namespace ckpt {

class CopyLane {
 public:
  virtual ~CopyLane() = default;
  // True when each copy has completed when it returns: the engine then keeps one chunk in
  // flight.
  virtual bool synchronous() const = 0;
  // The native queue (a cudaStream_t), or nullptr for host lanes.
  virtual void* native() const { return nullptr; }
  // Queues a copy of `len` bytes at `offset` of `region` into host memory `dst`, which
  // must stay valid until the chunk's ticket is waited for.
  virtual Status CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) = 0;
  // Queues a copy of `len` bytes of host memory `src` to `offset` of `region` (a restore),
  // under the same rules: `src` stays valid, and unchanged, until the chunk's ticket is
  // waited for. Host regions (and every region on a host lane) are written at once.
  virtual Status CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src,
                        std::size_t len) = 0;
  // Ends the chunk being queued and returns its ticket (tickets increase).
  virtual Result<std::uint64_t> EndChunk() = 0;
  // Blocks until every copy queued up to `ticket` is complete; returns the first error
  // among them. Tickets are waited for in order. Device lanes poll, and return an error
  // without waiting further once `give_up()` is true (the trainer whose event gates the
  // copies has exited: the event may never fire).
  virtual Status WaitChunk(std::uint64_t ticket, const std::function<bool()>& give_up) = 0;
  // True when nothing queued on the lane is still pending (never blocks). A lane, and the
  // host memory its copies write to, may be reused or freed only when it is idle.
  virtual bool Idle() = 0;
  // Makes the copies queued on this lane from now on wait for those queued on `other` so
  // far (no-op for host lanes).
  virtual Status After(CopyLane& other) = 0;
};

// Copies host memory (shm regions) with the region's ReadAt, on the calling thread.
class HostCopyLane final : public CopyLane {
 public:
  bool synchronous() const override { return true; }
  Status CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) override {
    return region.ReadAt(offset, dst, len);
  }
  Status CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src,
                std::size_t len) override {
    return region.WriteAt(offset, src, len);
  }
  Result<std::uint64_t> EndChunk() override { return ++tickets_; }
  Status WaitChunk(std::uint64_t, const std::function<bool()>&) override { return Status::Ok(); }
  bool Idle() override { return true; }
  Status After(CopyLane&) override { return Status::Ok(); }

 private:
  std::uint64_t tickets_ = 0;
};

// The device ordering of one version of one session.
class VersionSync {
 public:
  virtual ~VersionSync() = default;
  // Makes `lane` wait for the trainer's event of this version. Called once per lane,
  // before the lane's first copy of the version.
  virtual Status Gate(CopyLane& lane) = 0;
  // Records the daemon's completion event after every copy queued on `lanes` (lanes[0]
  // carries it). Called once, after the last copy of the version is queued.
  virtual Status Signal(const std::vector<CopyLane*>& lanes) = 0;
  // The daemon is done with this version's events (after Signal, or when the copy failed
  // or was abandoned). Idempotent; also done by the destructor.
  virtual void Release() = 0;
  // The slot of the daemon's ring that Signal records.
  virtual std::uint32_t daemon_slot() const = 0;
  // When the session's release words are written: the value Signal writes into the word of
  // daemon_slot() (never 0); nullopt otherwise.
  virtual std::optional<std::uint32_t> release_value() const { return std::nullopt; }
};

// A trainer's release words as the daemon mapped them (client/release_words.h): `bytes` of
// shared memory at `host`, valid while `keep` is held; the daemon's CPU never touches them,
// only its streams write them. `base` is CudaSession.release_base.
struct TrainerReleaseWords {
  void* host = nullptr;
  std::size_t bytes = 0;
  std::uint32_t base = 0;
  std::shared_ptr<const void> keep;
};

// The interprocess events of one CUDA registration: the trainer's ring (opened) and the
// daemon's ring (created).
class SessionEvents {
 public:
  virtual ~SessionEvents() = default;
  // Ordinal of the session's device in the daemon.
  virtual int device() const = 0;
  // The daemon ring's cudaIpcEventHandle_t bytes, for RegisterReply.daemon_events.
  virtual std::vector<std::string> daemon_handles() const = 0;
  // Takes the next daemon slot for `version`, whose trainer event is `trainer_slot`. A new
  // version acknowledges every earlier one: the trainer makes stream-ordered waits only on
  // its newest snapshot. Fails if the trainer slot is outside its ring or the daemon's
  // next slot still belongs to a version whose copies are being queued.
  virtual Result<std::shared_ptr<VersionSync>> Begin(std::uint64_t version, std::uint32_t trainer_slot) = 0;
  // Whether the versions' completion is also written into the trainer's release words.
  virtual bool writes_release_words() const { return false; }
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // One line for the log and `ckptctl status`, e.g. "CUDA 13.0: 1 device (NVIDIA H200 GPU-...)".
  virtual std::string Describe() const = 0;
  // True for region names this backend imports ("cuda:...").
  virtual bool Owns(std::string_view region_name) const = 0;
  // Imports region `name` for the client process `pid` (from SO_PEERCRED). The handle is
  // opened once per (pid, allocation) and shared by every region naming it.
  virtual Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, pid_t pid,
                                                         std::uint64_t min_size) = 0;
  // The client process exited: closes its allocations (once no copy uses them), and marks
  // the copies waiting on its events as abandoned (closes and unpins on their device are
  // put off while they are pending: see AwaitReleases).
  virtual void ReleaseClient(pid_t pid) = 0;
  // Device memory is closed and unpinned on a thread of the backend's own, never on the
  // caller's (the calls may synchronise behind a stuck stream). Blocks until what was dropped
  // before the call is closed, or `deadline`: Ok; FailedPrecondition when some closes are put
  // off (a copy on their device waits on the event of a trainer that exited);
  // DeadlineExceeded when a close has not returned.
  virtual Status AwaitReleases(std::chrono::steady_clock::time_point deadline) = 0;
  // Opens the events of a session of client process `pid` on the device with `device_uuid`
  // (32 hex digits). With `release_words` (may be null), the session also writes them where
  // the device can; where it cannot, the session works with events only
  // (writes_release_words() false).
  virtual Result<std::unique_ptr<SessionEvents>> OpenSession(pid_t pid, const std::string& device_uuid,
                                                             const std::vector<std::string>& trainer_events,
                                                             const TrainerReleaseWords* release_words) = 0;
  // `count` lanes copying out of regions on device `device`.
  virtual Result<std::vector<std::unique_ptr<CopyLane>>> MakeLanes(int device, std::uint32_t count) = 0;
  // Page-locks the host pool so device copies run at full speed (as portable memory, for
  // every device); Unpin undoes it. `numa_node` is the node holding the pool (-1: several or
  // unknown): the registration's context is made on a device near it.
  virtual Status Pin(void* base, std::size_t bytes, int numa_node) = 0;
  virtual void Unpin(void* base) = 0;
};

}  // namespace ckpt
