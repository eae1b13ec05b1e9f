// Turning CUDA runtime errors into ckpt::Status values.
//
// In: a cudaError_t and a description of the call. Out: a Status whose message names the
// call and CUDA's own error name and text. Errors that mean "there is no usable driver or
// device" map to kFailedPrecondition with the words "no CUDA driver/device", so callers
// and tests can tell a GPU-less machine from a failing GPU. Sticky errors also go to the
// handler the process installed (SetStickyErrorHandler). Thread-safe.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "common/status.h"

namespace ckpt::cuda {

// The phrase every "this machine cannot do CUDA" error contains.
inline constexpr const char* kNoDriverPhrase = "no CUDA driver/device";

// True for the errors CUDA reports when no driver is installed or no device is usable.
bool IsNoDeviceError(cudaError_t err);

// True for the "sticky" errors after which the process's CUDA context is unusable: CUDA 13's
// driver_types.h says of each that "any further CUDA work will return the same error" and
// "the process must be terminated and relaunched" (illegal address, launch failure, ...).
bool IsStickyContextError(cudaError_t err);

// Called by CudaStatus with the error's text whenever it sees a sticky error. None by
// default (the client library leaves the decision to its trainer); the daemon installs one
// that logs the error and exits non-zero, for systemd to restart it with a fresh context,
// rather than fail every shard from then on. Install it before any CUDA call is made.
void SetStickyErrorHandler(std::function<void(const std::string& message)> handler);

// Ok for cudaSuccess; otherwise an error "`what`: cudaErrorX (text)".
Status CudaStatus(cudaError_t err, const std::string& what);

}  // namespace ckpt::cuda
