#include "cuda/driver_api.h"

#include <string>

#include "cuda/cuda_error.h"

namespace ckpt::cuda {
namespace {

// A failed probe call as a "no CUDA driver/device" error.
Status NoDriver(cudaError_t err, const char* what) {
  Status s = CudaStatus(err, what);
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
  if (err != cudaSuccess) return NoDriver(err, "cudaDriverGetVersion");
  if (api.driver_version == 0) {
    return FailedPrecondition(std::string(kNoDriverPhrase) +
                              ": no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)");
  }
  err = probe.device_count(&api.device_count);
  if (err != cudaSuccess) return NoDriver(err, "cudaGetDeviceCount");
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
  return api;
}

const Result<DriverApi>& Driver() {
  static const Result<DriverApi> loaded = LoadDriverApi();
  return loaded;
}

}  // namespace ckpt::cuda
