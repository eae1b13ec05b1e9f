// HostPool: the daemon's bounded staging memory, allocated and faulted in once at start,
// cut into equal chunks. Copies take chunks, writes give them back; when every chunk is
// waiting for storage, Acquire blocks (backpressure), so memory never grows with the size
// of a checkpoint.
//
// Thread-safe. Chunk memory is aligned to 4 KiB (O_DIRECT).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/base/numa.h"

namespace ckpt {

class HostPool {
 public:
  // A chunk on loan; hand it back with Release().
  struct Chunk {
    std::uint32_t index = 0;
    char* data = nullptr;
  };

  // The pool's pages are placed by `numa` (daemon/base/numa.h) before they are touched.
  static Result<std::unique_ptr<HostPool>> Create(std::uint64_t pool_bytes, std::uint64_t chunk_bytes,
                                                  const NumaPlacement& numa = {});
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Blocks until a chunk is free; nullopt once Shutdown() was called.
  std::optional<Chunk> Acquire();
  // Takes a chunk if one is free now; never blocks. A caller that already holds chunks
  // must use this for more, or several such callers can deadlock holding parts of the pool.
  std::optional<Chunk> TryAcquire();
  void Release(const Chunk& chunk);
  // Wakes every waiter; later Acquire calls return nullopt.
  void Shutdown();

  std::uint64_t chunk_bytes() const { return chunk_bytes_; }
  std::uint64_t pool_bytes() const { return chunk_bytes_ * chunk_count_; }
  std::uint64_t used_bytes() const;
  // The pool's memory (pool_bytes() long), e.g. to page-lock it for device copies.
  void* base() const { return base_; }
  // Where its pages are, e.g. "node 0" (DescribeNumaNodes), and the one node holding them
  // all (-1: several, or unknown).
  const std::string& numa_nodes() const { return numa_nodes_; }
  int numa_node() const { return numa_node_; }
  // Runs `f` in the destructor before the memory is unmapped (e.g. to unpin it).
  void OnDestroy(std::function<void()> f) { on_destroy_ = std::move(f); }

 private:
  HostPool() = default;

  char* base_ = nullptr;
  std::string numa_nodes_ = "unknown";
  int numa_node_ = -1;
  std::function<void()> on_destroy_;
  std::uint64_t chunk_bytes_ = 0;
  std::uint32_t chunk_count_ = 0;
  mutable Mutex mu_;
  CondVar freed_;
  std::vector<std::uint32_t> free_ GUARDED_BY(mu_);
  bool shutdown_ GUARDED_BY(mu_) = false;
};

}  // namespace ckpt
