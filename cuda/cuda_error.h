// Turning CUDA runtime errors into ckpt::Status values.
//
// In: a cudaError_t and a description of the call. Out: a Status whose message names the
// call and CUDA's own error name and text. Errors that mean "there is no usable driver or
// device" map to kFailedPrecondition with the words "no CUDA driver/device", so callers
// and tests can tell a GPU-less machine from a failing GPU. Thread-safe (pure function).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"

namespace ckpt::cuda {

// The phrase every "this machine cannot do CUDA" error contains.
inline constexpr const char* kNoDriverPhrase = "no CUDA driver/device";

// True for the errors CUDA reports when no driver is installed or no device is usable.
bool IsNoDeviceError(cudaError_t err);

// Ok for cudaSuccess; otherwise an error "`what`: cudaErrorX (text)".
Status CudaStatus(cudaError_t err, const std::string& what);

}  // namespace ckpt::cuda
