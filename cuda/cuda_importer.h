// CudaIpcImporter: the daemon's access to trainer GPU memory exported with CUDA IPC.
//
// In: the region name a client put in its descriptor table for a CUDA allocation,
//   "cuda:<device uuid, 32 hex>:<cudaIpcMemHandle_t of the allocation base, 128 hex>"
// (176 characters, within the table's region field; item offsets are relative to the
// allocation base, since caching allocators sub-allocate). The importer is bound to one
// client session: its pid (from SO_PEERCRED, never from the request) keys the handle
// cache. Out: an ImportedRegion whose ReadAt/WriteAt copy between the allocation and host
// memory with cudaMemcpyAsync on a daemon-owned stream, then synchronise that stream.
//
// The device is chosen by UUID (cudaGetDeviceProperties().uuid), never by ordinal: the
// trainer and the daemon may see different CUDA_VISIBLE_DEVICES. A CUDA allocation has no
// owner uid to check; trust comes from the session's peer credentials, which the service
// checks before any import. A mapped allocation cannot shrink, so CurrentSize() is the
// allocation size; a tensor freed and reallocated is caught by the client's revalidation
// before each snapshot. UnlinkIfOrphaned() does nothing: there is no name to unlink, and
// the cache closes the handle when the client's registrations go (ReleaseClient).
//
// On a machine without a driver or device every Import fails with "no CUDA driver/device".
//
// Thread-safety: Import and the regions' methods are thread-safe; several copy threads
// may read one region at once (each borrows its own stream).
#pragma once

#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/region_importer.h"
#include "common/mutex.h"
#include "common/status.h"
#include "cuda/ipc_handle_cache.h"
#include "cuda/region_name.h"

namespace ckpt::cuda {

// Opens handles with cudaIpcOpenMemHandle (lazy peer access) and sizes the allocation
// with the driver's cuMemGetAddressRange.
class CudaIpcOpener : public IpcOpener {
 public:
  Result<IpcMapping> Open(const IpcHandle& handle, int device) override;
  Status Close(const IpcMapping& mapping) override;
};

// Streams owned by the daemon for its copies, created on first use per device, lent to
// one copy at a time and destroyed with the pool. Thread-safe.
class CopyStreamPool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    cudaStream_t stream() const { return stream_; }

   private:
    friend class CopyStreamPool;
    CopyStreamPool* pool_ = nullptr;
    int device_ = -1;
    cudaStream_t stream_ = nullptr;
  };

  CopyStreamPool() = default;
  ~CopyStreamPool();
  CopyStreamPool(const CopyStreamPool&) = delete;
  CopyStreamPool& operator=(const CopyStreamPool&) = delete;

  // A stream of `device` (the calling thread's current device is set to it). Leases must
  // end before the pool is destroyed.
  Result<Lease> Borrow(int device);

 private:
  void Return(int device, cudaStream_t stream);

  Mutex mu_;
  std::map<int, std::vector<cudaStream_t>> idle_ GUARDED_BY(mu_);
  std::vector<std::pair<int, cudaStream_t>> all_ GUARDED_BY(mu_);
};

class CudaIpcImporter : public RegionImporter {
 public:
  CudaIpcImporter(std::shared_ptr<IpcHandleCache> cache, std::shared_ptr<CopyStreamPool> streams,
                  pid_t client_pid);

  // `owner` is not checked (see above); `min_size` is checked against the allocation size.
  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, uid_t owner,
                                                 std::uint64_t min_size) override;

 private:
  std::shared_ptr<IpcHandleCache> cache_;
  std::shared_ptr<CopyStreamPool> streams_;
  pid_t pid_;
};

}  // namespace ckpt::cuda
