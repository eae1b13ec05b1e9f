#include "cuda/region_name.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "cuda/cuda_error.h"
#include "cuda/driver_api.h"

namespace ckpt::cuda {

static_assert(sizeof(cudaUUID_t) == sizeof(DeviceUuid{}.bytes));

namespace {

int Nibble(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The devices this process sees, read once.
struct DeviceTable {
  Status status;
  std::vector<DeviceUuid> uuids;  // by ordinal
};

const DeviceTable& Devices() {
  static const DeviceTable table = [] {
    DeviceTable t;
    const auto& driver = Driver();
    if (!driver.ok()) {
      t.status = driver.status();
      return t;
    }
    for (int i = 0; i < driver.value().device_count; ++i) {
      cudaDeviceProp prop{};
      if (Status s = CudaStatus(::cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties"); !s.ok()) {
        t.status = s;
        return t;
      }
      DeviceUuid u;
      std::memcpy(u.bytes.data(), prop.uuid.bytes, u.bytes.size());
      t.uuids.push_back(u);
    }
    return t;
  }();
  return table;
}

}  // namespace

// ---- names ------------------------------------------------------------------------------

std::string DeviceUuid::Hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

std::string DeviceUuid::Pretty() const {
  std::string hex = Hex();
  return "GPU-" + hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" +
         hex.substr(16, 4) + "-" + hex.substr(20);
}

Result<DeviceUuid> DeviceUuid::Parse(std::string_view text) {
  std::string_view digits = text;
  std::string compact;
  if (text.starts_with("GPU-")) {
    // GPU-8-4-4-4-12
    std::string_view rest = text.substr(4);
    static constexpr std::size_t kDashes[] = {8, 13, 18, 23};
    if (rest.size() != 36) return InvalidArgument("device UUID " + std::string(text) + " is malformed");
    for (std::size_t i = 0; i < rest.size(); ++i) {
      bool dash_here = false;
      for (std::size_t d : kDashes) dash_here |= (i == d);
      if (dash_here != (rest[i] == '-')) {
        return InvalidArgument("device UUID " + std::string(text) + " is malformed");
      }
      if (!dash_here) compact.push_back(rest[i]);
    }
    digits = compact;
  }
  if (digits.size() != 32) {
    return InvalidArgument("device UUID " + std::string(text) + " is not 32 hex digits");
  }
  DeviceUuid u;
  for (std::size_t i = 0; i < 16; ++i) {
    int hi = Nibble(digits[2 * i]), lo = Nibble(digits[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("device UUID " + std::string(text) + " is not hex");
    u.bytes[i] = static_cast<std::uint8_t>(hi << 4 | lo);
  }
  return u;
}

bool IsCudaRegionName(std::string_view name) { return name.starts_with(kCudaRegionPrefix); }

std::string FormatCudaRegionName(const CudaRegionRef& ref) {
  return std::string(kCudaRegionPrefix) + ref.device.Hex() + ":" + ref.handle.Hex();
}

Result<CudaRegionRef> ParseCudaRegionName(std::string_view name) {
  if (!IsCudaRegionName(name)) {
    return InvalidArgument("region name does not start with " + std::string(kCudaRegionPrefix));
  }
  std::string_view rest = name.substr(kCudaRegionPrefix.size());
  const std::size_t colon = rest.find(':');
  if (colon == std::string_view::npos) {
    return InvalidArgument("CUDA region name lacks the ':' between device UUID and IPC handle");
  }
  CudaRegionRef ref;
  auto uuid = DeviceUuid::Parse(rest.substr(0, colon));
  if (!uuid.ok()) return uuid.status().With("CUDA region name");
  ref.device = uuid.value();
  auto handle = IpcHandle::FromHex(rest.substr(colon + 1));
  if (!handle.ok()) return handle.status().With("CUDA region name");
  ref.handle = handle.value();
  return ref;
}

Result<int> DeviceOrdinalForUuid(const DeviceUuid& uuid) {
  const DeviceTable& t = Devices();
  if (!t.status.ok()) return t.status;
  for (std::size_t i = 0; i < t.uuids.size(); ++i) {
    if (t.uuids[i] == uuid) return static_cast<int>(i);
  }
  return NotFound("CUDA device " + uuid.Pretty() + " is not visible to ckptd (it sees " +
                  std::to_string(t.uuids.size()) + " devices; check CUDA_VISIBLE_DEVICES of the daemon)");
}

}  // namespace ckpt::cuda
