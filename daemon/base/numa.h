// NUMA placement of the host pool: where its pages live decides how fast the copies into
// it (device-to-host DMA, memcpy from shm) and the writes out of it run.
//
//   local       the kernel's default: first touch, i.e. the node of the thread that starts
//               the daemon (systemd or numactl decide which);
//   interleave  pages spread round-robin over every node the daemon may use (its cpuset),
//               so the copies of GPUs on every socket see the same average distance;
//   N           every page on node N (the node nearest the GPUs this daemon serves).
//
// Through the mbind / get_mempolicy / move_pages system calls (no libnuma needed). A kernel
// without NUMA support takes "local" only. Thread-safe (no state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ckpt {

struct NumaPlacement {
  enum class Mode { kLocal, kInterleave, kNode };
  Mode mode = Mode::kLocal;
  int node = -1;  // kNode only

  // "local", "interleave" or a node number.
  static Result<NumaPlacement> Parse(std::string_view text);
  std::string Name() const;
};

// The NUMA nodes this process may allocate on (its cpuset's mems), ascending.
Result<std::vector<int>> AllowedNumaNodes();

// Sets the policy of the (not yet touched) memory [base, base + bytes). Fails naming the
// node when it is not one the daemon may use. kLocal does nothing.
Status ApplyNumaPlacement(void* base, std::size_t bytes, const NumaPlacement& placement);

// Pages of [base, base + bytes) per node, from one page every `stride` bytes (a multiple
// of the page size); empty if the kernel cannot tell.
std::map<int, std::uint64_t> SampleNumaNodes(const void* base, std::size_t bytes, std::size_t stride);

// "node 0", "nodes 0 (50%), 1 (50%)", or "unknown".
std::string DescribeNumaNodes(const std::map<int, std::uint64_t>& pages);

}  // namespace ckpt
