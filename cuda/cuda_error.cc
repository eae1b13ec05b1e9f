#include "cuda/cuda_error.h"

#include <utility>

#include "common/mutex.h"

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

namespace {

Mutex g_sticky_mu;
std::function<void(const std::string&)>& StickyHandler() REQUIRES(g_sticky_mu) {
  static std::function<void(const std::string&)> handler;
  return handler;
}

}  // namespace

bool IsStickyContextError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    case cudaErrorContained:
    // Not worded so in the header, but an uncorrectable ECC error leaves the context as
    // unusable (NVIDIA's Xid 48 guidance: restart the application).
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

void SetStickyErrorHandler(std::function<void(const std::string& message)> handler) {
  MutexLock lock(g_sticky_mu);
  StickyHandler() = std::move(handler);
}

Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  std::string text = what + ": " + ::cudaGetErrorName(err) + " (" + ::cudaGetErrorString(err) + ")";
  if (IsStickyContextError(err)) {
    std::function<void(const std::string&)> handler;
    {
      MutexLock lock(g_sticky_mu);
      handler = StickyHandler();
    }
    if (handler) handler(text);
  }
  if (IsNoDeviceError(err)) return FailedPrecondition(std::string(kNoDriverPhrase) + ": " + text);
  if (err == cudaErrorMemoryAllocation) return ResourceExhausted(text);
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevicePointer ||
      err == cudaErrorInvalidResourceHandle || err == cudaErrorMapBufferObjectFailed) {
    return InvalidArgument(text);
  }
  return Internal(text);
}

}  // namespace ckpt::cuda
