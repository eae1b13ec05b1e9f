// A test seam: a device backend for ckptd on machines without a GPU, so that tests can
// drive a real daemon process through its GPU paths and see every open and close of
// "device" memory.
//
//   CKPTD_TEST_DEVICE=log=PATH[,block_close=PATH2][,sticky_copy=1]
//
// Region names are CUDA ones ("cuda:<uuid>:<handle>", any uuid: one device, ordinal 0);
// the handle's bytes, up to the first NUL, name a POSIX shared-memory object standing for
// the trainer's allocation. What the daemon's CUDA backend gets from the driver is faked
// here; the rest is the production code: the IPC handle cache (one open per (pid,
// allocation), closed with its last holder) and the DeviceReleaser (closes on a thread of
// their own, put off while the LaneWatch reports an abandoned lane).
//
// Each open and close appends a line "open NAME" / "close NAME" to the log (written before
// the call returns, so a test reads it as soon as an RPC replied). With block_close, a close
// first logs "closing NAME" and then waits as long as PATH2 exists (a close stuck behind a
// stream). With sticky_copy=1 every device copy fails with cudaErrorIllegalAddress through
// CudaStatus, as a real sticky error would. Copies are synchronous memcpy; the session
// events are inert (Gate and Signal do nothing).
//
// Unset (always, outside tests), MakeTestDeviceBackend returns null and costs nothing.
#pragma once

#include <memory>

#include "backend/device_copier.h"
#include "common/status.h"

namespace ckpt::cuda {

// The backend CKPTD_TEST_DEVICE asks for; null when it is unset, an error when it is malformed.
Result<std::shared_ptr<DeviceBackend>> MakeTestDeviceBackend();

}  // namespace ckpt::cuda
