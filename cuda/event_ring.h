// Event rings: one CUDA interprocess event per version slot, reused round-robin, with the
// rule that an event is never recorded again while a peer may still wait on it.
//
// Two rings exist per registered client, one on each side of the socket:
//   - the trainer's ring: at snapshot(v) the client records the slot's event on its
//     current stream; the daemon's copy streams wait on it before copying v;
//   - the daemon's ring: once the copies of v are enqueued the daemon records the slot's
//     event after them; a stream-ordered wait_snapshot(v) makes a client stream wait on it.
// In both, the recorder must not record a slot's event again until (a) the daemon is done
// with version v (captured, or failed: MarkCaptured) and (b) the client has acknowledged v,
// that is, has made every wait on v it will make, or moved past v (Acknowledge /
// AcknowledgeThrough). cudaStreamWaitEvent waits for the record that was current when it
// was called; across processes nothing orders that call against a new record except this
// rule.
//
// Slots go round-robin in assignment order (the n-th assigned version gets slot n % N), so
// both sides compute the same slot from the same sequence of versions; the daemon checks
// the slot the client names. Versions must increase.
//
// EventSlotRing is the pure bookkeeping (no CUDA). EventRing adds the events, created and
// recorded through the IpcEvent interface (CUDA in production, fakes in tests).
//
// Thread-safety: EventSlotRing and EventRing are thread-safe (one mutex each).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "cuda/ipc_handle_cache.h"

namespace ckpt::cuda {

class EventSlotRing {
 public:
  // A ring of `slots` slots (1..1024).
  static Result<std::unique_ptr<EventSlotRing>> Create(std::uint32_t slots);

  std::uint32_t slots() const { return slot_count_; }

  // The slot the next Assign will take, and whether it is free to take now.
  std::uint32_t next_slot() const;
  // The version still holding the next slot, if any (what to wait for before Assign).
  std::optional<std::uint64_t> BlockingVersion() const;

  // Gives `version` the next slot. Fails with kFailedPrecondition if the version does not
  // increase, and with kResourceExhausted if the next slot's previous version is not yet
  // both captured and acknowledged (the slot's event may still be waited on).
  Result<std::uint32_t> Assign(std::uint64_t version);
  // The slot of an assigned, not yet reused version.
  Result<std::uint32_t> SlotOf(std::uint64_t version) const;

  // The daemon is done with `version`: captured, or failed and no longer using the events.
  Status MarkCaptured(std::uint64_t version);
  // The client has made every wait on `version` it will make.
  Status Acknowledge(std::uint64_t version);
  // The client moved past every version <= `version` (e.g. its next snapshot arrived).
  void AcknowledgeThrough(std::uint64_t version);

  // True when the slot holds no version, or one both captured and acknowledged.
  bool Reusable(std::uint32_t slot) const;

 private:
  struct Slot {
    bool used = false;
    std::uint64_t version = 0;
    bool captured = false;
    bool acked = false;
  };
  explicit EventSlotRing(std::uint32_t slots) : slot_count_(slots), slots_(slots) {}
  Result<std::uint32_t> FindLocked(std::uint64_t version) const REQUIRES(mu_);

  const std::uint32_t slot_count_;
  mutable Mutex mu_;
  std::vector<Slot> slots_ GUARDED_BY(mu_);     // slot_count_ long
  std::uint64_t assigned_ GUARDED_BY(mu_) = 0;  // versions assigned so far
  std::optional<std::uint64_t> last_version_ GUARDED_BY(mu_);
};

// One interprocess event.
class IpcEvent {
 public:
  virtual ~IpcEvent() = default;
  // Records the event on `stream` (a cudaStream_t; nullptr is the legacy default stream).
  virtual Status Record(void* stream) = 0;
  // Makes `stream` wait for the event's most recent record.
  virtual Status StreamWait(void* stream) = 0;
  // Blocks the calling thread until the most recent record has completed.
  virtual Status Synchronize() = 0;
  // The cudaIpcEventHandle_t bytes a peer opens the event with.
  virtual const IpcHandle& handle() const = 0;
};

// Creates the events of a ring; the CUDA one creates cudaEventInterprocess |
// cudaEventDisableTiming events on a device, or opens a peer's event handles.
class IpcEventFactory {
 public:
  virtual ~IpcEventFactory() = default;
  virtual Result<std::unique_ptr<IpcEvent>> Create() = 0;
  virtual Result<std::unique_ptr<IpcEvent>> Open(const IpcHandle& handle) = 0;
};

// The CUDA factory for events on device `device` (an ordinal of this process).
std::unique_ptr<IpcEventFactory> MakeCudaEventFactory(int device);

class EventRing {
 public:
  // Creates `slots` new events (the recording side of a ring).
  static Result<std::unique_ptr<EventRing>> Create(std::uint32_t slots, IpcEventFactory& factory);
  // Opens a peer's events by their handles (the waiting side of a ring).
  static Result<std::unique_ptr<EventRing>> Open(const std::vector<IpcHandle>& handles,
                                                 IpcEventFactory& factory);

  EventSlotRing& slots() { return *slots_; }
  std::vector<IpcHandle> handles() const;

  // Assigns `version` its slot and records that slot's event on `stream`. Fails, without
  // recording anything, if the slot may still be waited on (see EventSlotRing::Assign).
  Result<std::uint32_t> RecordVersion(std::uint64_t version, void* stream);
  // Makes `stream` wait on the event of `version` (the waiting side). The waiting side's
  // ring assigns slots as the versions are announced to it, with Assign.
  Status WaitVersion(std::uint64_t version, void* stream);

  // Slot-addressed use, where the peer names the slot over the wire (the daemon's and the
  // client's rings are then independent; the caller keeps the reuse rule through slots()).
  std::uint32_t size() const { return static_cast<std::uint32_t>(events_.size()); }
  Status RecordSlot(std::uint32_t slot, void* stream);
  Status WaitSlot(std::uint32_t slot, void* stream);
  Status SynchronizeSlot(std::uint32_t slot);

 private:
  EventRing() = default;
  std::unique_ptr<EventSlotRing> slots_;
  std::vector<std::unique_ptr<IpcEvent>> events_;
};

}  // namespace ckpt::cuda
