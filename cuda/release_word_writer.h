// ReleaseWordWriter: the daemon's side of a trainer's release words (client/release_words.h
// has the design): after a version's copies, the daemon's copy stream writes the version's
// release value into the word of its daemon event slot, and the trainer's stream, waiting
// on that word (cuStreamWaitValue32, cyclic >=), runs on.
//
// In: the trainer's words as the daemon mapped them (backend/device_copier.h,
// TrainerReleaseWords) and the session's device. Out: writes queued on daemon streams. The
// CUDA writer page-locks the words for the device (cudaHostRegister, mapped and portable;
// cudaHostGetDevicePointer gives the address) and queues cuStreamWriteValue32 with
// CU_STREAM_WRITE_VALUE_DEFAULT (a fence before the write, so the copies' bytes are in host
// memory first). MakeSessionEvents (cuda/cuda_backend.h) takes any writer; tests give it a
// fake that records the writes.
//
// Thread-safety: Write is called by one copy thread at a time per version; the CUDA writer
// is thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/device_copier.h"
#include "cuda/device_releaser.h"
#include "common/status.h"

namespace ckpt::cuda {

class ReleaseWordWriter {
 public:
  virtual ~ReleaseWordWriter() = default;
  // How many words the trainer's page holds.
  virtual std::uint32_t count() const = 0;
  // CudaSession.release_base: the session's n-th version writes base + n.
  virtual std::uint32_t base() const = 0;
  // Queues on `stream` (a cudaStream_t) the write of `value` into word `slot`, after the
  // work queued there so far.
  virtual Status Write(void* stream, std::uint32_t slot, std::uint32_t value) = 0;
};

// The CUDA writer on `device` (an ordinal of the daemon). Fails, and the session then uses
// its events only, when the driver lacks cuStreamWriteValue32 or the words cannot be
// registered for the device; the message says which. With `releaser`, the words are
// unregistered on its thread (cuda/device_releaser.h), never on the thread that drops the
// writer.
Result<std::unique_ptr<ReleaseWordWriter>> MakeCudaReleaseWordWriter(
    int device, const TrainerReleaseWords& words, std::shared_ptr<DeviceReleaser> releaser = nullptr);

}  // namespace ckpt::cuda
