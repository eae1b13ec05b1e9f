// DriverApi: the few CUDA driver functions the backend needs, reached without linking the
// driver library.
//
// Binaries link only the CUDA runtime (libcudart); libcuda.so.1 exists only where an NVIDIA
// driver is installed, and a binary linked against it would not even start elsewhere.
// The driver functions (cuMemGetAddressRange, cuPointerGetAttribute, ...) are looked up
// through cudaGetDriverEntryPointByVersion, pinned to the ABI of kDriverAbiVersion so the
// function types below stay right whatever driver is installed.
//
// In: nothing (the process-wide table) or a DriverProbe (tests inject fakes).
// Out: a table of function pointers, or a Status. On a machine without a driver or
// without a device, the status is kFailedPrecondition and its message starts with
// "no CUDA driver/device"; nothing aborts and nothing crashes.
//
// Thread-safety: Driver() loads the table once (C++ static initialisation) and returns
// the same immutable result to every caller afterwards, success or failure. The table's
// functions are the driver's own and are thread-safe.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "common/status.h"

namespace ckpt::cuda {

// Every entry point is requested with the ABI of CUDA 12.0; the PFN_*_vNNNN types below are
// the newest ABI of each function at or before that version.
inline constexpr unsigned kDriverAbiVersion = 12000;

struct DriverApi {
  PFN_cuMemGetAddressRange_v3020 cuMemGetAddressRange = nullptr;
  PFN_cuPointerGetAttribute_v4000 cuPointerGetAttribute = nullptr;
  PFN_cuPointerGetAttributes_v7000 cuPointerGetAttributes = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuCtxSetCurrent_v4000 cuCtxSetCurrent = nullptr;
  // Stream memory operations (the release words, client/release_words.h). Optional: null
  // when the driver does not provide them; callers then use interprocess events. The
  // 32-bit operations of this ABI (the "v2" memops of CUDA 11.7+) need no device attribute:
  // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 is deprecated in the CUDA 13 header, and
  // a platform that cannot still answers CUDA_ERROR_NOT_SUPPORTED at the call.
  PFN_cuStreamWriteValue32_v11070 cuStreamWriteValue32 = nullptr;
  PFN_cuStreamWaitValue32_v11070 cuStreamWaitValue32 = nullptr;
  int driver_version = 0;  // as cudaDriverGetVersion reports it, e.g. 13000
  int device_count = 0;    // devices visible to this process (at least 1 when loaded)

  // "cuX: CUDA_ERROR_Y (text)" for a driver result, Ok for CUDA_SUCCESS.
  Status Check(CUresult r, const char* what) const;
};

// What the loader asks of the CUDA runtime; the default calls the real runtime, tests
// replace single functions.
struct DriverProbe {
  std::function<cudaError_t(int*)> driver_version = [](int* v) { return ::cudaDriverGetVersion(v); };
  std::function<cudaError_t(int*)> device_count = [](int* n) { return ::cudaGetDeviceCount(n); };
  std::function<cudaError_t(int*)> runtime_version = [](int* v) { return ::cudaRuntimeGetVersion(v); };
  std::function<cudaError_t(const char*, void**, cudaDriverEntryPointQueryResult*)> entry_point =
      [](const char* symbol, void** fn, cudaDriverEntryPointQueryResult* q) {
        return ::cudaGetDriverEntryPointByVersion(symbol, fn, kDriverAbiVersion, cudaEnableDefault, q);
      };
};

// The minimum NVIDIA driver for a CUDA runtime: the static CUDA 13 runtime these binaries
// link needs a driver that supports CUDA 13.0, branch R580 or newer (CUDA 13.0 release
// notes: 580.65.06 on Linux); within CUDA 13, minor-version compatibility makes any R580
// driver enough. `runtime_version` as cudaRuntimeGetVersion reports it (13000).
std::string MinimumDriverFor(int runtime_version);

// The message for a driver too old for this binary's runtime (cudaErrorInsufficientDriver):
// names the driver's CUDA version (`driver_version` from cudaDriverGetVersion, 0 if
// unknown), the runtime's and the driver branch needed, e.g. "the NVIDIA driver supports
// CUDA 12.4 (cudaDriverGetVersion: 12040), older than this binary's CUDA 13.0 runtime,
// which needs NVIDIA driver R580 or newer (...): upgrade the driver".
std::string DriverTooOldMessage(int driver_version, int runtime_version);

// Loads the table through `probe`. Fails with "no CUDA driver/device: ..." when the driver
// is missing or sees no device (with DriverTooOldMessage when the driver is older than the
// runtime), and with a message naming the symbol when an entry point
// cannot be found.
Result<DriverApi> LoadDriverApi(const DriverProbe& probe = DriverProbe());

// The process-wide table, loaded on first use.
const Result<DriverApi>& Driver();

}  // namespace ckpt::cuda
