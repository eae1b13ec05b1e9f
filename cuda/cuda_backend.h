// CudaBackend: the daemon's DeviceBackend on the CUDA runtime (see backend/device_copier.h).
//
// In: region names "cuda:<uuid>:<handle>" (cuda/region_name.h) with the client's pid,
// the trainers' event handles, and the host pool to page-lock. Out: imported regions
// (one cudaIpcOpenMemHandle per (pid, allocation), cached), copy lanes on daemon-owned
// non-blocking streams (cudaMemcpyAsync device to host, one CUDA event per chunk), and
// per-session event rings.
//
// Session events: the trainer's ring (opened from its handles) gates the copies of a
// version (cudaStreamWaitEvent on every lane before its first copy); the daemon's ring
// (created here, 64 interprocess events) is recorded after the last copy. A daemon slot is
// recorded again only when its previous version is released by the copy thread and
// acknowledged by the trainer; the trainer acknowledges every earlier version by taking a
// new snapshot (the client never makes a stream-ordered wait on a version older than its
// newest snapshot). Slots are assigned by a per-session sequence, so a rollback that
// repeats version numbers does not disturb the ring. Where the trainer sent release words
// and the device can write them, Signal first writes the version's release value (the
// session's base + its sequence) into the word of its daemon slot (cuda/release_word_writer.h).
//
// Device memory is given back on a thread of its own (cuda/device_releaser.h): every close
// of an IPC mapping and the pool's unpin, put off while a lane waits on the event of a
// trainer that exited (cuda/lane_watch.h). Every lane call sets the lane's device first.
//
// MakeCudaBackend fails with "no CUDA driver/device: ..." on machines without a GPU; the
// daemon then runs without a device backend.
//
// Thread-safety: everything is thread-safe, except that one CopyLane is used by one thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "backend/device_copier.h"
#include "common/status.h"
#include "cuda/event_ring.h"
#include "cuda/release_word_writer.h"

namespace ckpt::cuda {

// Slots of the daemon's event ring per session.
inline constexpr std::uint32_t kDaemonEventSlots = 64;

Result<std::shared_ptr<DeviceBackend>> MakeCudaBackend();

// The session-event logic on any event factory (CUDA in production, fakes in tests).
// `device` is the daemon's ordinal of the session's device; `trainer_gone` (made if null)
// is the flag the backend sets when the trainer exits. `words` (may be null) writes the
// trainer's release words after each version's copies; fewer words than daemon slots means
// events only.
Result<std::unique_ptr<SessionEvents>> MakeSessionEvents(
    std::unique_ptr<IpcEventFactory> factory, int device, const std::vector<std::string>& trainer_handles,
    std::uint32_t daemon_slots = kDaemonEventSlots, std::shared_ptr<std::atomic<bool>> trainer_gone = nullptr,
    std::unique_ptr<ReleaseWordWriter> words = nullptr);

}  // namespace ckpt::cuda
