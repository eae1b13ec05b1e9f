#include "daemon/pipeline/host_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace ckpt {

Result<std::unique_ptr<HostPool>> HostPool::Create(std::uint64_t pool_bytes, std::uint64_t chunk_bytes,
                                                   const NumaPlacement& numa) {
  if (chunk_bytes == 0 || chunk_bytes % 4096 != 0 || pool_bytes < chunk_bytes) {
    return InvalidArgument("pool of " + std::to_string(pool_bytes) + " bytes cannot hold chunks of " +
                           std::to_string(chunk_bytes));
  }
  std::unique_ptr<HostPool> pool(new HostPool());
  pool->chunk_bytes_ = chunk_bytes;
  pool->chunk_count_ = static_cast<std::uint32_t>(pool_bytes / chunk_bytes);
  std::uint64_t bytes = chunk_bytes * pool->chunk_count_;
  // Every page is faulted in now, so the pool's memory is claimed at start and a daemon
  // that starts cannot later fail for lack of it: by MAP_POPULATE, or, when a NUMA policy
  // must be set first, by touching each page once it is.
  const bool local = numa.mode == NumaPlacement::Mode::kLocal;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (local ? MAP_POPULATE : 0), -1, 0);
  if (p == MAP_FAILED) return IoError("allocate host pool of " + std::to_string(bytes) + " bytes", errno);
  pool->base_ = static_cast<char*>(p);
  if (!local) {
    if (Status s = ApplyNumaPlacement(p, bytes, numa); !s.ok()) return s;
    const long page = ::sysconf(_SC_PAGESIZE);
    for (std::uint64_t off = 0; off < bytes; off += static_cast<std::uint64_t>(page)) {
      static_cast<volatile char*>(p)[off] = 0;
    }
  }
  // One sample per chunk, at most ~4096 samples.
  const std::uint64_t stride = std::max<std::uint64_t>(chunk_bytes, bytes / 4096 / 4096 * 4096);
  const auto nodes = SampleNumaNodes(p, bytes, stride);
  pool->numa_nodes_ = DescribeNumaNodes(nodes);
  if (nodes.size() == 1) pool->numa_node_ = nodes.begin()->first;
  MutexLock lock(pool->mu_);
  for (std::uint32_t i = pool->chunk_count_; i-- > 0;) pool->free_.push_back(i);
  return pool;
}

HostPool::~HostPool() {
  if (on_destroy_) on_destroy_();
  if (base_ != nullptr) ::munmap(base_, chunk_bytes_ * chunk_count_);
}

std::optional<HostPool::Chunk> HostPool::Acquire() {
  MutexLock lock(mu_);
  while (!shutdown_ && free_.empty()) freed_.Wait(mu_);
  if (shutdown_) return std::nullopt;
  std::uint32_t i = free_.back();
  free_.pop_back();
  return Chunk{i, base_ + std::uint64_t{i} * chunk_bytes_};
}

std::optional<HostPool::Chunk> HostPool::TryAcquire() {
  MutexLock lock(mu_);
  if (shutdown_ || free_.empty()) return std::nullopt;
  std::uint32_t i = free_.back();
  free_.pop_back();
  return Chunk{i, base_ + std::uint64_t{i} * chunk_bytes_};
}

void HostPool::Release(const Chunk& chunk) {
  {
    MutexLock lock(mu_);
    free_.push_back(chunk.index);
  }
  freed_.Signal();
}

void HostPool::Shutdown() {
  {
    MutexLock lock(mu_);
    shutdown_ = true;
  }
  freed_.SignalAll();
}

std::uint64_t HostPool::used_bytes() const {
  MutexLock lock(mu_);
  return (chunk_count_ - free_.size()) * chunk_bytes_;
}

}  // namespace ckpt
