#include "cuda/cuda_error.h"

namespace ckpt::cuda {

bool IsNoDeviceError(cudaError_t err) {
  switch (err) {
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
      return true;
    default:
      return false;
  }
}

Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  std::string text = what + ": " + ::cudaGetErrorName(err) + " (" + ::cudaGetErrorString(err) + ")";
  if (IsNoDeviceError(err)) return FailedPrecondition(std::string(kNoDriverPhrase) + ": " + text);
  if (err == cudaErrorMemoryAllocation) return ResourceExhausted(text);
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevicePointer ||
      err == cudaErrorInvalidResourceHandle || err == cudaErrorMapBufferObjectFailed) {
    return InvalidArgument(text);
  }
  return Internal(text);
}

}  // namespace ckpt::cuda
