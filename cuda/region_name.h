// Region names of CUDA allocations, and devices by UUID.
//
// A trainer's GPU tensor lives in a CUDA allocation that the client exports with
// cudaIpcGetMemHandle; the descriptor table names that allocation's region
//   "cuda:<device uuid, 32 hex>:<cudaIpcMemHandle_t of the allocation base, 128 hex>"
// (176 characters, within the table's region field; item offsets are relative to the
// allocation base, since caching allocators sub-allocate). Shared by the client (which
// formats names) and the daemon (which parses them).
//
// Thread-safety: pure functions, except DeviceOrdinalForUuid, which reads the device table
// once (thread-safe static initialisation).
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "cuda/ipc_handle_cache.h"

namespace ckpt::cuda {

inline constexpr std::string_view kCudaRegionPrefix = "cuda:";

struct DeviceUuid {
  std::array<std::uint8_t, 16> bytes{};
  auto operator<=>(const DeviceUuid&) const = default;
  // 32 lowercase hex digits.
  std::string Hex() const;
  // As nvidia-smi shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
  std::string Pretty() const;
  // Accepts the 32-digit form or nvidia-smi's form.
  static Result<DeviceUuid> Parse(std::string_view text);
};

// What a CUDA region name carries.
struct CudaRegionRef {
  DeviceUuid device;
  IpcHandle handle;
};

bool IsCudaRegionName(std::string_view name);
std::string FormatCudaRegionName(const CudaRegionRef& ref);
Result<CudaRegionRef> ParseCudaRegionName(std::string_view name);

// The ordinal (in this process's numbering) of the device with `uuid`. The table of
// devices is read once; fails with "no CUDA driver/device" on a machine without one and
// with kNotFound naming the UUID when no visible device has it.
Result<int> DeviceOrdinalForUuid(const DeviceUuid& uuid);

}  // namespace ckpt::cuda
