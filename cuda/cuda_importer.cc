#include "cuda/cuda_importer.h"

#include <cstring>
#include <utility>

#include "cuda/cuda_error.h"
#include "cuda/driver_api.h"
#include "cuda/pid_namespace.h"

namespace ckpt::cuda {

static_assert(sizeof(cudaIpcMemHandle_t) == IpcHandle::kBytes);

namespace {

class CudaImportedRegion : public ImportedRegion {
 public:
  CudaImportedRegion(std::string name, IpcHandleCache::Registration registration,
                     std::shared_ptr<CopyStreamPool> streams)
      : name_(std::move(name)), registration_(std::move(registration)), streams_(std::move(streams)) {}

  const std::string& name() const override { return name_; }

  Result<std::uint64_t> CurrentSize() const override { return registration_.mapping().size; }

  Status ReadAt(std::uint64_t offset, void* dst, std::size_t len) const override {
    return Copy(offset, len, [&](char* device_ptr, cudaStream_t stream) {
      return CudaStatus(::cudaMemcpyAsync(dst, device_ptr, len, cudaMemcpyDeviceToHost, stream),
                        "cudaMemcpyAsync device to host");
    });
  }

  Status WriteAt(std::uint64_t offset, const void* src, std::size_t len) const override {
    return Copy(offset, len, [&](char* device_ptr, cudaStream_t stream) {
      return CudaStatus(::cudaMemcpyAsync(device_ptr, src, len, cudaMemcpyHostToDevice, stream),
                        "cudaMemcpyAsync host to device");
    });
  }

  void UnlinkIfOrphaned() const override {}

  int device() const override { return registration_.mapping().device; }

  Result<DeviceSpan> DeviceAt(std::uint64_t offset, std::size_t len) const override {
    std::shared_ptr<const IpcMapping> mapping = registration_.Lock();
    if (Status s = CheckRange(mapping.get(), offset, len); !s.ok()) return s;
    return DeviceSpan{static_cast<char*>(mapping->base) + offset, mapping};
  }

 private:
  Status CheckRange(const IpcMapping* mapping, std::uint64_t offset, std::size_t len) const {
    if (mapping == nullptr) {
      return FailedPrecondition("CUDA region " + name_ + " is closed: its client was released");
    }
    if (offset > mapping->size || len > mapping->size - offset) {
      return FailedPrecondition("CUDA region " + name_ + " is " + std::to_string(mapping->size) +
                                " bytes, smaller than offset " + std::to_string(offset) + " + " +
                                std::to_string(len));
    }
    return Status::Ok();
  }

  template <typename Enqueue>
  Status Copy(std::uint64_t offset, std::size_t len, Enqueue enqueue) const {
    // Holding the mapping keeps it open even if the client is released meanwhile.
    std::shared_ptr<const IpcMapping> mapping = registration_.Lock();
    if (Status s = CheckRange(mapping.get(), offset, len); !s.ok()) return s;
    if (len == 0) return Status::Ok();
    auto lease = streams_->Borrow(mapping->device);
    if (!lease.ok()) return lease.status().With("CUDA region " + name_);
    char* device_ptr = static_cast<char*>(mapping->base) + offset;
    if (Status s = enqueue(device_ptr, lease.value().stream()); !s.ok()) {
      (void)::cudaStreamSynchronize(lease.value().stream());  // let anything enqueued finish
      return s.With("CUDA region " + name_);
    }
    return CudaStatus(::cudaStreamSynchronize(lease.value().stream()), "cudaStreamSynchronize")
        .With("CUDA region " + name_);
  }

  std::string name_;
  IpcHandleCache::Registration registration_;
  std::shared_ptr<CopyStreamPool> streams_;
};

}  // namespace

// ---- opener -----------------------------------------------------------------------------

Result<IpcMapping> CudaIpcOpener::Open(const IpcHandle& handle, int device) {
  const auto& driver = Driver();
  if (!driver.ok()) return driver.status();
  if (Status s = CudaStatus(::cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  cudaIpcMemHandle_t h;
  std::memcpy(h.reserved, handle.bytes.data(), IpcHandle::kBytes);
  void* ptr = nullptr;
  if (Status s =
          CudaStatus(::cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
      !s.ok()) {
    return s;
  }
  CUdeviceptr base = 0;
  std::size_t size = 0;
  Status s = driver.value().Check(
      driver.value().cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)),
      "cuMemGetAddressRange");
  const auto opened = reinterpret_cast<CUdeviceptr>(ptr);
  if (s.ok() && (opened < base || opened - base >= size)) {
    s = Internal("cuMemGetAddressRange places the opened CUDA IPC pointer outside its own range");
  }
  if (!s.ok()) {
    (void)::cudaIpcCloseMemHandle(ptr);
    return s;
  }
  // The opened pointer is where the exporter's allocation starts (item offsets are relative
  // to it). cudaMalloc may carve small allocations out of a larger block, and the range the
  // driver reports here may then be that block: the usable size ends where the range does.
  return IpcMapping{ptr, static_cast<std::uint64_t>(base + size - opened), device};
}

Status CudaIpcOpener::Close(const IpcMapping& mapping) {
  if (Status s = CudaStatus(::cudaSetDevice(mapping.device), "cudaSetDevice"); !s.ok()) return s;
  return CudaStatus(::cudaIpcCloseMemHandle(mapping.base), "cudaIpcCloseMemHandle");
}

// ---- streams ----------------------------------------------------------------------------

CopyStreamPool::Lease& CopyStreamPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->Return(device_, stream_);
    pool_ = std::exchange(other.pool_, nullptr);
    device_ = std::exchange(other.device_, -1);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CopyStreamPool::Lease::~Lease() {
  if (pool_ != nullptr) pool_->Return(device_, stream_);
}

CopyStreamPool::~CopyStreamPool() {
  for (auto& [device, stream] : all_) {
    if (::cudaSetDevice(device) == cudaSuccess) (void)::cudaStreamDestroy(stream);
  }
}

Result<CopyStreamPool::Lease> CopyStreamPool::Borrow(int device) {
  if (Status s = CudaStatus(::cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  Lease lease;
  {
    MutexLock lock(mu_);
    auto& idle = idle_[device];
    if (!idle.empty()) {
      lease.stream_ = idle.back();
      idle.pop_back();
    }
  }
  if (lease.stream_ == nullptr) {
    cudaStream_t stream = nullptr;
    if (Status s = CudaStatus(::cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    MutexLock lock(mu_);
    all_.emplace_back(device, stream);
    lease.stream_ = stream;
  }
  lease.pool_ = this;
  lease.device_ = device;
  return lease;
}

void CopyStreamPool::Return(int device, cudaStream_t stream) {
  MutexLock lock(mu_);
  idle_[device].push_back(stream);
}

// ---- importer ---------------------------------------------------------------------------

CudaIpcImporter::CudaIpcImporter(std::shared_ptr<IpcHandleCache> cache,
                                 std::shared_ptr<CopyStreamPool> streams, pid_t client_pid)
    : cache_(std::move(cache)), streams_(std::move(streams)), pid_(client_pid) {}

Result<std::shared_ptr<ImportedRegion>> CudaIpcImporter::Import(const std::string& name, uid_t /*owner*/,
                                                                std::uint64_t min_size) {
  auto ref = ParseCudaRegionName(name);
  if (!ref.ok()) return ref.status();
  auto device = DeviceOrdinalForUuid(ref.value().device);
  if (!device.ok()) return device.status().With("import CUDA region");
  auto registration = cache_->Register(pid_, ref.value().handle, device.value());
  if (!registration.ok()) {
    const Status& s = registration.status();
    // The one cause of a failed open that the CUDA error does not name.
    if (s.message().find("cudaIpcOpenMemHandle") == std::string::npos) return s;
    const std::string note = PidNamespaceNoteFor(pid_);
    return note.empty() ? s : Status(s.code(), s.message() + "; " + note);
  }
  if (registration.value().mapping().size < min_size) {
    return InvalidArgument("CUDA allocation of region " + name + " is " +
                           std::to_string(registration.value().mapping().size) + " bytes, smaller than the " +
                           std::to_string(min_size) + " its items need");
  }
  return std::shared_ptr<ImportedRegion>(
      std::make_shared<CudaImportedRegion>(name, std::move(registration).value(), streams_));
}

}  // namespace ckpt::cuda
