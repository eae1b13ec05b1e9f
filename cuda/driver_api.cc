#include "cuda/driver_api.h"

#include <string>

#include "cuda/cuda_error.h"

namespace ckpt::cuda {
namespace {

std::string CudaVersionText(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// A failed probe call as a "no CUDA driver/device" error; a driver older than the runtime
// says which driver is there and which one is needed.
Status NoDriver(const DriverProbe& probe, cudaError_t err, const char* what, int driver_version) {
  Status s = CudaStatus(err, what);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorCallRequiresNewerDriver) {
    int runtime = 0;
    if (probe.runtime_version(&runtime) != cudaSuccess) runtime = CUDART_VERSION;
    return FailedPrecondition(std::string(kNoDriverPhrase) + ": " +
                              DriverTooOldMessage(driver_version, runtime) + " (" + s.message() + ")");
  }
  if (IsNoDeviceError(err)) return s;  // already says "no CUDA driver/device"
  return FailedPrecondition(std::string(kNoDriverPhrase) + ": " + s.message());
}

Status LoadSymbol(const DriverProbe& probe, const char* symbol, void** fn) {
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = probe.entry_point(symbol, fn, &query);
  if (err != cudaSuccess) {
    return CudaStatus(err, std::string("cudaGetDriverEntryPointByVersion(") + symbol + ")");
  }
  if (query == cudaDriverEntryPointVersionNotSufficent) {
    return FailedPrecondition("the CUDA driver is older than version " + std::to_string(kDriverAbiVersion) +
                              " and lacks " + symbol);
  }
  if (query != cudaDriverEntryPointSuccess || *fn == nullptr) {
    return FailedPrecondition(std::string("the CUDA driver does not provide ") + symbol);
  }
  return Status::Ok();
}

}  // namespace

std::string MinimumDriverFor(int runtime_version) {
  switch (runtime_version / 1000) {
    case 13:
      return "R580 or newer (580.65.06 or later on Linux)";
    case 12:
      return "R525 or newer (525.60.13 or later on Linux)";
    default:
      return "one that supports CUDA " + CudaVersionText(runtime_version);
  }
}

std::string DriverTooOldMessage(int driver_version, int runtime_version) {
  const std::string found = driver_version > 0
                                ? "the NVIDIA driver supports CUDA " + CudaVersionText(driver_version) +
                                      " (cudaDriverGetVersion: " + std::to_string(driver_version) + ")"
                                : "the NVIDIA driver's CUDA version is unknown";
  return found + ", older than this binary's CUDA " + CudaVersionText(runtime_version) +
         " runtime, which needs NVIDIA driver " + MinimumDriverFor(runtime_version) +
         ": upgrade the driver on this node (see README, GPU requirements)";
}

Status DriverApi::Check(CUresult r, const char* what) const {
  if (r == CUDA_SUCCESS) return Status::Ok();
  const char* text = nullptr;
  if (cuGetErrorString == nullptr || cuGetErrorString(r, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "unknown error";
  }
  std::string msg =
      std::string(what) + ": CUresult " + std::to_string(static_cast<int>(r)) + " (" + text + ")";
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_FOUND) return InvalidArgument(msg);
  return Internal(msg);
}

Result<DriverApi> LoadDriverApi(const DriverProbe& probe) {
  DriverApi api;
  // cudaDriverGetVersion reports 0 (and success) when libcuda.so.1 cannot be loaded.
  cudaError_t err = probe.driver_version(&api.driver_version);
  if (err != cudaSuccess) return NoDriver(probe, err, "cudaDriverGetVersion", 0);
  if (api.driver_version == 0) {
    return FailedPrecondition(std::string(kNoDriverPhrase) +
                              ": no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)");
  }
  err = probe.device_count(&api.device_count);
  if (err != cudaSuccess) return NoDriver(probe, err, "cudaGetDeviceCount", api.driver_version);
  if (api.device_count <= 0) {
    return FailedPrecondition(std::string(kNoDriverPhrase) + ": the CUDA driver (version " +
                              std::to_string(api.driver_version) + ") sees no device");
  }
  struct {
    const char* name;
    void** slot;
  } symbols[] = {
      {"cuMemGetAddressRange", reinterpret_cast<void**>(&api.cuMemGetAddressRange)},
      {"cuPointerGetAttribute", reinterpret_cast<void**>(&api.cuPointerGetAttribute)},
      {"cuPointerGetAttributes", reinterpret_cast<void**>(&api.cuPointerGetAttributes)},
      {"cuGetErrorString", reinterpret_cast<void**>(&api.cuGetErrorString)},
      {"cuCtxGetCurrent", reinterpret_cast<void**>(&api.cuCtxGetCurrent)},
      {"cuCtxSetCurrent", reinterpret_cast<void**>(&api.cuCtxSetCurrent)},
  };
  for (auto& s : symbols) {
    if (Status st = LoadSymbol(probe, s.name, s.slot); !st.ok()) return st;
  }
  struct {
    const char* name;
    void** slot;
  } optional[] = {
      {"cuStreamWriteValue32", reinterpret_cast<void**>(&api.cuStreamWriteValue32)},
      {"cuStreamWaitValue32", reinterpret_cast<void**>(&api.cuStreamWaitValue32)},
  };
  for (auto& s : optional) {
    if (!LoadSymbol(probe, s.name, s.slot).ok()) *s.slot = nullptr;
  }
  return api;
}

const Result<DriverApi>& Driver() {
  static const Result<DriverApi> loaded = LoadDriverApi();
  return loaded;
}

}  // namespace ckpt::cuda
