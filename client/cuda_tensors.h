// The GPU side of a client registration (private to libckpt): tensors in CUDA memory that
// the daemon imports with CUDA IPC, and the interprocess event rings that order the
// daemon's copies after the trainer's update and the trainer's next update after them.
//
// In: the registration's GPU tensors (name, device pointer, bytes). Out: for each, its
// descriptor-table row (region "cuda:<device uuid>:<IPC handle of the allocation base>",
// offset from that base, generation = the allocation's buffer id); the device UUID and
// the trainer ring's event handles for RegisterRequest.cuda; per snapshot, a revalidation
// of every allocation and a trainer event recorded on the caller's stream; per
// stream-ordered wait, a stream wait on the daemon's event.
//
// The slot rule (TrainerSlotBook): the n-th snapshot records slot n % 64 of the trainer's
// ring, and a slot is recorded again only once the daemon is past waiting on the version
// it holds, which the client knows when a Wait RPC on that version returned (any level,
// either form, success or the version's failure). cudaStreamWaitEvent waits for the record
// current when it was called; across processes nothing else orders a new record against a
// peer's pending wait.
//
// The CUDA implementation is client/cuda_tensors.cc, compiled only when libckpt is built
// with CUDA; without it ResolveCudaTensors fails with "this libckpt was built without
// CUDA" (client/registration.cc). This header has no CUDA types, so the rest of libckpt
// compiles either way.
//
// Thread-safety: CudaTensors is safe to use from several threads (its event rings are
// fixed once made, CUDA's calls are thread-safe, and every call restores the calling
// thread's current device). TrainerSlotBook is a plain value: the client guards it with
// its registration mutex.
#pragma once

#include <grpcpp/support/status_code_enum.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace ckpt {

// Slots of the trainer's event ring.
inline constexpr std::uint32_t kTrainerEventSlots = 64;

// A GPU tensor as register_items received it.
struct CudaTensorSpec {
  std::string name;
  const void* ptr = nullptr;
  std::uint64_t bytes = 0;
};

// What the descriptor table holds for a GPU tensor.
struct CudaTableRow {
  std::string region;            // "cuda:<32 hex>:<128 hex>"
  std::uint64_t offset = 0;      // bytes from the allocation's base
  std::uint64_t generation = 0;  // the allocation's buffer id
};

class CudaTensors {
 public:
  virtual ~CudaTensors() = default;

  // One row per GPU tensor, in the order given to ResolveCudaTensors.
  virtual const std::vector<CudaTableRow>& rows() const = 0;
  // The device's UUID, 32 hex digits (CudaSession.device_uuid).
  virtual const std::string& device_uuid() const = 0;

  // Provides the event rings before registering: takes over `previous`'s rings when it is
  // the registration of the same session on the same device (returns true: its slot
  // bookkeeping still holds), else creates a new trainer ring (returns false). `previous`
  // may be null.
  virtual Result<bool> PrepareEvents(const CudaTensors* previous) = 0;
  // The trainer ring's cudaIpcEventHandle_t bytes, one per slot (CudaSession.trainer_events).
  virtual std::vector<std::string> trainer_event_handles() const = 0;
  // Opens the daemon's ring from RegisterReply.daemon_events; keeps the ring already open
  // when the handles are the same.
  virtual Status OpenDaemonEvents(const std::vector<std::string>& handles) = 0;

  // Checks that every registered allocation is still the one registered. The error names a
  // tensor: "tensor 'X' moved or was freed since registration: register again ...".
  virtual Status Revalidate() const = 0;
  // Records slot `slot` of the trainer's ring on `stream` (a cudaStream_t; null: the legacy
  // default stream).
  virtual Status RecordTrainerEvent(std::uint32_t slot, void* stream) = 0;
  // Makes `stream` wait on slot `slot` of the daemon's ring.
  virtual Status WaitDaemonEvent(std::uint32_t slot, void* stream) = 0;
  // Page-locks the trainer's release words (client/release_words.h) for the device
  // (cudaHostRegister, mapped and portable: one registration serves every device and
  // context) and returns what keeps them registered, or why they cannot be (the client then
  // waits on the daemon's events). The default: this CudaTensors cannot.
  virtual Result<std::shared_ptr<const void>> MapReleaseWords(void* words, std::size_t bytes) {
    (void)words;
    (void)bytes;
    return FailedPrecondition("stream memory operations are not available");
  }
  // Makes `stream` wait until the release word at host address `word` (inside the words
  // MapReleaseWords registered) reaches `value`, cyclically: cuStreamWaitValue32 with
  // CU_STREAM_WAIT_VALUE_GEQ. Returns false, queuing nothing, when the device cannot wait
  // on memory (CUDA_ERROR_NOT_SUPPORTED): then the caller waits on the daemon's event.
  virtual Result<bool> WaitReleaseWord(const void* word, std::uint32_t value, void* stream) {
    (void)word;
    (void)value;
    (void)stream;
    return false;
  }
  // Waits for all work queued on the tensors' device (before a restore writes into them:
  // the daemon's streams are not ordered after the trainer's).
  virtual Status SynchronizeDevice() const = 0;
};

// Finds each tensor's allocation through the CUDA driver, checks it (device memory, not
// managed, exportable with cudaIpcGetMemHandle, within its allocation, one device for all)
// and exports each distinct allocation once. Fails with a message naming the tensor and
// the way out; with "no CUDA driver/device" on a machine without one; with "this libckpt
// was built without CUDA" when built so. `tensors` is not empty.
Result<std::shared_ptr<CudaTensors>> ResolveCudaTensors(const std::vector<CudaTensorSpec>& tensors);

// A test seam: while set, register_items resolves GPU tensors with `resolver` instead of
// ResolveCudaTensors, so that tests without a GPU can drive the client's GPU bookkeeping
// (event slots, re-registration after a daemon restart) with a fake CudaTensors. An empty
// function restores the real one. Thread-safe.
using CudaTensorsResolver =
    std::function<Result<std::shared_ptr<CudaTensors>>(const std::vector<CudaTensorSpec>&)>;
void SetCudaTensorsResolverForTesting(CudaTensorsResolver resolver);

// Which slot of the trainer's ring the next snapshot records, and which version still
// holds it (see the slot rule above). Not thread-safe.
class TrainerSlotBook {
 public:
  explicit TrainerSlotBook(std::uint32_t slots = kTrainerEventSlots) : holders_(slots == 0 ? 1 : slots) {}

  std::uint32_t size() const { return static_cast<std::uint32_t>(holders_.size()); }
  // The slot the next snapshot records.
  std::uint32_t next_slot() const { return static_cast<std::uint32_t>(taken_ % holders_.size()); }
  // The version whose Wait must return before the next slot may be recorded again, if any.
  std::optional<std::uint64_t> MustWaitFor() const { return holders_[next_slot()]; }
  // `version` recorded the next slot (the caller checked MustWaitFor() first); returns it.
  std::uint32_t Take(std::uint64_t version) {
    const std::uint32_t slot = next_slot();
    holders_[slot] = version;
    ++taken_;
    return slot;
  }
  // A Wait RPC on `version` returned: the daemon waits on its slot's event no longer.
  void Release(std::uint64_t version) {
    for (auto& holder : holders_) {
      if (holder == version) holder.reset();
    }
  }
  // The version holding `slot`, if any.
  std::optional<std::uint64_t> holder(std::uint32_t slot) const {
    return slot < holders_.size() ? holders_[slot] : std::nullopt;
  }

 private:
  std::vector<std::optional<std::uint64_t>> holders_;
  std::uint64_t taken_ = 0;  // slots taken so far
};

// Whether a Wait RPC that returned `code` tells that the daemon is past the version: it
// reached the level, failed, or is unknown to the daemon. A timeout, a cancelled call or
// an unreachable daemon tell nothing.
inline bool WaitReleasesSlot(grpc::StatusCode code) {
  return code != grpc::StatusCode::DEADLINE_EXCEEDED && code != grpc::StatusCode::CANCELLED &&
         code != grpc::StatusCode::UNAVAILABLE;
}

// Whether wait_snapshot_on_stream(version) makes a stream-ordered wait: only for a
// registration with GPU tensors and a version no older than the last snapshot (after a
// snapshot the client never stream-waits on older versions: the daemon may reuse their
// events); otherwise it is wait_snapshot.
inline bool UseStreamOrderedWait(bool has_gpu_tensors, std::uint64_t last_snapshot, std::uint64_t version) {
  return has_gpu_tensors && version >= last_snapshot;
}

}  // namespace ckpt
