#include "cuda/pointer_query.h"

#include <iterator>

namespace ckpt::cuda {

Result<PointerAttributes> QueryPointerAttributes(const DriverApi& driver, std::uint64_t address) {
  unsigned memory_type = 0;
  // Boolean attributes: the driver writes at most this many bytes, zero-extended here.
  unsigned long long managed = 0;
  unsigned long long ipc_capable = 0;
  int ordinal = -1;
  unsigned long long buffer_id = 0;
  CUpointer_attribute attributes[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
      CU_POINTER_ATTRIBUTE_IS_MANAGED,
      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_BUFFER_ID,
  };
  void* data[] = {&memory_type, &managed, &ipc_capable, &ordinal, &buffer_id};
  static_assert(std::size(attributes) == std::size(data));
  const auto ptr = static_cast<CUdeviceptr>(address);
  CUresult r =
      driver.cuPointerGetAttributes(static_cast<unsigned>(std::size(attributes)), attributes, data, ptr);
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_CONTEXT) return PointerAttributes{};
  if (Status s = driver.Check(r, "cuPointerGetAttributes"); !s.ok()) return s;
  PointerAttributes a;
  a.memory_type = memory_type;
  a.managed = managed != 0;
  a.legacy_ipc_capable = ipc_capable != 0;
  a.device_ordinal = ordinal;
  a.buffer_id = static_cast<std::uint64_t>(buffer_id);
  if (a.memory_type != kMemoryTypeDevice || a.managed) return a;  // refused by the checks; no range needed
  CUdeviceptr base = 0;
  std::size_t size = 0;
  r = driver.cuMemGetAddressRange(&base, &size, ptr);
  // Freed between the two queries: nothing is there now.
  if (r == CUDA_ERROR_NOT_FOUND || r == CUDA_ERROR_INVALID_VALUE) return PointerAttributes{};
  if (Status s = driver.Check(r, "cuMemGetAddressRange"); !s.ok()) return s;
  a.range_start = static_cast<std::uint64_t>(base);
  a.range_size = static_cast<std::uint64_t>(size);
  return a;
}

}  // namespace ckpt::cuda
