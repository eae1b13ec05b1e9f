// Pointer checks for GPU tensors: what the client decides from the driver's attributes of
// a tensor's address, kept apart from the driver calls so tests feed it made-up values.
//
// In: per tensor, its name, address and byte length, and the attributes the driver reports
// for that address (cuPointerGetAttributes: memory type, managed, legacy-IPC capable,
// device ordinal, buffer id; and cuMemGetAddressRange: allocation start and size, see
// cuda/pointer_query.h). Out: an error naming the tensor
// and the way out, or the plan of a registration: its one device, its distinct allocations
// (each exported once, with cudaIpcGetMemHandle of its base) and each tensor's offset from
// its allocation's base. Before each snapshot, CheckAllocationUnchanged compares what the
// driver says about an allocation's base now with what it said at registration: a tensor
// freed (cudaFree) or reallocated elsewhere shows as another start, size or buffer id.
// Memory a caching allocator frees to its own cache and hands out again keeps its CUDA
// allocation, so only a re-registration can tell about that.
//
// Header-only, so the client library and the tests use it without another library.
// Thread-safety: pure functions on plain values.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ckpt::cuda {

// CUmemorytype values (cuda.h), repeated so this header needs no CUDA include.
inline constexpr unsigned kMemoryTypeUnknown = 0;  // the driver does not know the address
inline constexpr unsigned kMemoryTypeHost = 1;
inline constexpr unsigned kMemoryTypeDevice = 2;

// What the driver reports for one address. A default-constructed value is what
// cuPointerGetAttributes reports for an address CUDA does not know.
struct PointerAttributes {
  unsigned memory_type = kMemoryTypeUnknown;
  bool managed = false;             // cudaMallocManaged
  bool legacy_ipc_capable = false;  // cudaIpcGetMemHandle can export the allocation
  int device_ordinal = -1;          // in this process's numbering
  std::uint64_t range_start = 0;    // the allocation's first byte (cuMemGetAddressRange)
  std::uint64_t range_size = 0;     // the allocation's bytes (cuMemGetAddressRange)
  std::uint64_t buffer_id = 0;      // unique per allocation over the process's lifetime
};

// One GPU tensor of a registration, with the attributes of its address.
struct TensorPointer {
  std::string name;
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  PointerAttributes attributes;
};

// One CUDA allocation holding registered tensors.
struct Allocation {
  std::uint64_t base = 0;
  std::uint64_t size = 0;
  std::uint64_t buffer_id = 0;
  std::string first_tensor;  // named in errors about the allocation
  std::size_t tensor_count = 0;
};

// Where a registration's GPU tensors live.
struct AllocationPlan {
  int device = -1;                         // ordinal of the one device
  std::vector<Allocation> allocations;     // in order of first appearance
  std::vector<std::size_t> allocation_of;  // per tensor: index into `allocations`
  std::vector<std::uint64_t> offset_of;    // per tensor: bytes from its allocation's base
};

inline std::string HexAddress(std::uint64_t address) {
  char text[2 + 16 + 1];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

// Ok when `t` can be exported with CUDA IPC and lies within its allocation; otherwise an
// InvalidArgument naming the tensor, what its memory is and what to do instead.
inline Status CheckTensorPointer(const TensorPointer& t) {
  const PointerAttributes& a = t.attributes;
  const std::string what = "GPU tensor '" + t.name + "' at " + HexAddress(t.address);
  if (a.managed) {
    return InvalidArgument(what +
                           " is managed memory (cudaMallocManaged), which CUDA IPC cannot "
                           "export: allocate it with cudaMalloc");
  }
  if (a.memory_type == kMemoryTypeUnknown) {
    return InvalidArgument(what +
                           " is not device memory CUDA knows (a host pointer, or memory "
                           "already freed): pass a device pointer from cudaMalloc, or put "
                           "host tensors in a ckpt::SharedRegion");
  }
  if (a.memory_type == kMemoryTypeHost) {
    return InvalidArgument(what +
                           " is host memory (pinned or registered with CUDA), not device "
                           "memory: put host tensors in a ckpt::SharedRegion");
  }
  if (a.memory_type != kMemoryTypeDevice) {
    return InvalidArgument(what + " is not device memory (CUDA memory type " + std::to_string(a.memory_type) +
                           "): allocate it with cudaMalloc");
  }
  if (!a.legacy_ipc_capable) {
    return InvalidArgument(what +
                           " lives in a cuMem/VMM allocation (or a stream-ordered memory "
                           "pool), which cudaIpcGetMemHandle cannot export, e.g. PyTorch "
                           "expandable_segments: set "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or allocate "
                           "with cudaMalloc");
  }
  if (a.device_ordinal < 0) {
    return InvalidArgument(what + ": the CUDA driver reports no device for it");
  }
  const bool inside = a.range_size > 0 && t.address >= a.range_start &&
                      t.address - a.range_start <= a.range_size &&
                      t.bytes <= a.range_size - (t.address - a.range_start);
  if (!inside) {
    return InvalidArgument(what + " has " + std::to_string(t.bytes) +
                           " bytes, which run past the end of its allocation (" + HexAddress(a.range_start) +
                           ", " + std::to_string(a.range_size) + " bytes): check its shape and dtype");
  }
  return Status::Ok();
}

// Checks every tensor (CheckTensorPointer), that all are on one device, and groups them by
// allocation. Fails with InvalidArgument naming the tensor(s) at fault.
inline Result<AllocationPlan> PlanAllocations(const std::vector<TensorPointer>& tensors) {
  AllocationPlan plan;
  std::string device_tensor;  // the first tensor, named when another is on another device
  for (const TensorPointer& t : tensors) {
    if (Status s = CheckTensorPointer(t); !s.ok()) return s;
    const PointerAttributes& a = t.attributes;
    if (plan.device < 0) {
      plan.device = a.device_ordinal;
      device_tensor = t.name;
    } else if (a.device_ordinal != plan.device) {
      return InvalidArgument("GPU tensors '" + device_tensor + "' (device " + std::to_string(plan.device) +
                             ") and '" + t.name + "' (device " + std::to_string(a.device_ordinal) +
                             ") are on different devices: one registration takes the tensors of "
                             "one device (use one client per device)");
    }
    std::size_t index = plan.allocations.size();
    for (std::size_t i = 0; i < plan.allocations.size(); ++i) {
      if (plan.allocations[i].base == a.range_start) index = i;
    }
    if (index == plan.allocations.size()) {
      plan.allocations.push_back(Allocation{a.range_start, a.range_size, a.buffer_id, t.name, 0});
    } else if (plan.allocations[index].size != a.range_size ||
               plan.allocations[index].buffer_id != a.buffer_id) {
      // Only a free and a new allocation between two queries gives one base two identities.
      return InvalidArgument("GPU tensors '" + plan.allocations[index].first_tensor + "' and '" + t.name +
                             "' report different allocations at " + HexAddress(a.range_start) +
                             ": was memory freed while registering?");
    }
    ++plan.allocations[index].tensor_count;
    plan.allocation_of.push_back(index);
    plan.offset_of.push_back(t.address - a.range_start);
  }
  return plan;
}

// Ok when the driver's attributes of `registered`'s base address (`now`) still describe the
// allocation seen at registration on device `device`; otherwise FailedPrecondition naming
// the allocation's first tensor.
inline Status CheckAllocationUnchanged(const Allocation& registered, int device,
                                       const PointerAttributes& now) {
  std::string found;
  if (now.memory_type == kMemoryTypeUnknown) {
    found = "no allocation is there any more";
  } else if (now.range_start != registered.base || now.range_size != registered.size ||
             now.buffer_id != registered.buffer_id || now.device_ordinal != device) {
    found = "the address now belongs to another allocation (" + HexAddress(now.range_start) + ", " +
            std::to_string(now.range_size) + " bytes, buffer id " + std::to_string(now.buffer_id) + ")";
  } else {
    return Status::Ok();
  }
  std::string others;
  if (registered.tensor_count > 1) {
    others = " (with " + std::to_string(registered.tensor_count - 1) + " other tensors of that allocation)";
  }
  return FailedPrecondition("tensor '" + registered.first_tensor +
                            "' moved or was freed since registration: "
                            "register again" +
                            others + "; it was registered in allocation " + HexAddress(registered.base) +
                            " (" + std::to_string(registered.size) + " bytes, buffer id " +
                            std::to_string(registered.buffer_id) + "), and " + found);
}

}  // namespace ckpt::cuda
