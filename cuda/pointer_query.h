// What the CUDA driver says about one address, as the pointer checks of cuda/cuda_pointer.h
// take it.
//
// In: the driver table (cuda/driver_api.h; tests fill one with fake functions) and an
// address in this process. Out: its PointerAttributes, or a Status naming the driver call.
//
// The allocation's base and size come from cuMemGetAddressRange, never from the pointer
// attributes CU_POINTER_ATTRIBUTE_RANGE_START_ADDR/RANGE_SIZE: the CUDA 13 header
// (cuda.h, cuPointerGetAttribute) says those give "the mappable address range ... not
// necessarily the mapped region; see cuMemGetAddressRange". cudaMalloc sub-allocates small
// allocations out of larger blocks, and CUDA IPC shares the allocation cuMemGetAddressRange
// names, so the export, the offsets and the revalidation all use that one. The buffer id
// (CU_POINTER_ATTRIBUTE_BUFFER_ID) stays the allocation's identity.
//
// Thread-safety: a pure function of the driver's answers.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "cuda/cuda_pointer.h"
#include "cuda/driver_api.h"

namespace ckpt::cuda {

// An address CUDA does not know gives default attributes (memory type unknown), as
// cuPointerGetAttributes documents; a driver that reports such an address (or one whose
// allocation is gone) as an invalid value, context or "not found" means the same.
Result<PointerAttributes> QueryPointerAttributes(const DriverApi& driver, std::uint64_t address);

}  // namespace ckpt::cuda
