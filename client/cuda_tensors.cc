// The CUDA implementation of client/cuda_tensors.h: driver queries, IPC export, event
// rings. Compiled into libckpt only when it is built with CUDA (CKPT_HAVE_CUDA).
#include "client/cuda_tensors.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "cuda/cuda_error.h"
#include "cuda/cuda_pointer.h"
#include "cuda/driver_api.h"
#include "cuda/event_ring.h"
#include "cuda/pointer_query.h"
#include "cuda/region_name.h"

namespace ckpt {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == cuda::IpcHandle::kBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == cuda::IpcHandle::kBytes);

// The CUDA calls the client makes for the trainer (event creation, records, waits) set the
// calling thread's current device; this puts the trainer's own context back afterwards,
// including "none": asking cudaGetDevice on a thread without a context would answer 0 and
// restoring that would create a context on GPU 0 in every rank.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() {
    const auto& driver = cuda::Driver();
    if (driver.ok() && driver->cuCtxGetCurrent(&context_) == CUDA_SUCCESS) driver_ = &driver.value();
  }
  ~CurrentDeviceGuard() {
    CUcontext now = nullptr;
    if (driver_ != nullptr && driver_->cuCtxGetCurrent(&now) == CUDA_SUCCESS && now != context_) {
      (void)driver_->cuCtxSetCurrent(context_);
    }
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  const cuda::DriverApi* driver_ = nullptr;
  CUcontext context_ = nullptr;
};

Result<cuda::IpcHandle> ParseEventHandle(const std::string& bytes, std::size_t index) {
  if (bytes.size() != cuda::IpcHandle::kBytes) {
    return InvalidArgument("the daemon's event " + std::to_string(index) + " is " +
                           std::to_string(bytes.size()) + " bytes, not a cudaIpcEventHandle_t (" +
                           std::to_string(cuda::IpcHandle::kBytes) + ")");
  }
  cuda::IpcHandle h;
  std::memcpy(h.bytes.data(), bytes.data(), h.bytes.size());
  return h;
}

class CudaTensorsImpl : public CudaTensors {
 public:
  CudaTensorsImpl(cuda::AllocationPlan plan, std::string device_uuid, std::vector<CudaTableRow> rows)
      : plan_(std::move(plan)), device_uuid_(std::move(device_uuid)), rows_(std::move(rows)) {}

  ~CudaTensorsImpl() override {
    // Destroying an event sets the current device.
    CurrentDeviceGuard guard;
    trainer_ring_.reset();
    daemon_ring_.reset();
  }

  const std::vector<CudaTableRow>& rows() const override { return rows_; }
  const std::string& device_uuid() const override { return device_uuid_; }

  Result<bool> PrepareEvents(const CudaTensors* previous) override {
    auto* prev = dynamic_cast<const CudaTensorsImpl*>(previous);
    if (prev != nullptr && prev->plan_.device == plan_.device && prev->trainer_ring_) {
      trainer_ring_ = prev->trainer_ring_;
      daemon_ring_ = prev->daemon_ring_;
      return true;
    }
    CurrentDeviceGuard guard;
    auto factory = cuda::MakeCudaEventFactory(plan_.device);
    auto ring = cuda::EventRing::Create(kTrainerEventSlots, *factory);
    if (!ring.ok()) return ring.status().With("create the trainer's CUDA event ring on device " + Device());
    trainer_ring_ = std::move(ring).value();
    return false;
  }

  std::vector<std::string> trainer_event_handles() const override {
    std::vector<std::string> out;
    if (!trainer_ring_) return out;
    for (const cuda::IpcHandle& h : trainer_ring_->handles()) {
      out.emplace_back(reinterpret_cast<const char*>(h.bytes.data()), h.bytes.size());
    }
    return out;
  }

  Status OpenDaemonEvents(const std::vector<std::string>& handles) override {
    std::vector<cuda::IpcHandle> parsed;
    for (std::size_t i = 0; i < handles.size(); ++i) {
      auto h = ParseEventHandle(handles[i], i);
      if (!h.ok()) return h.status();
      parsed.push_back(h.value());
    }
    if (parsed.empty()) {
      daemon_ring_.reset();
      return Status::Ok();
    }
    if (daemon_ring_ && daemon_ring_->handles() == parsed) return Status::Ok();
    CurrentDeviceGuard guard;
    auto factory = cuda::MakeCudaEventFactory(plan_.device);
    auto ring = cuda::EventRing::Open(parsed, *factory);
    if (!ring.ok()) return ring.status().With("open the daemon's CUDA event ring on device " + Device());
    daemon_ring_ = std::move(ring).value();
    return Status::Ok();
  }

  Status Revalidate() const override {
    const auto& driver = cuda::Driver();
    if (!driver.ok()) return driver.status();
    for (const cuda::Allocation& a : plan_.allocations) {
      auto now = cuda::QueryPointerAttributes(driver.value(), a.base);
      if (!now.ok()) return now.status().With("check tensor '" + a.first_tensor + "'");
      if (Status s = cuda::CheckAllocationUnchanged(a, plan_.device, now.value()); !s.ok()) return s;
    }
    return Status::Ok();
  }

  Status RecordTrainerEvent(std::uint32_t slot, void* stream) override {
    if (!trainer_ring_) return FailedPrecondition("the trainer's CUDA event ring was not created");
    CurrentDeviceGuard guard;
    return trainer_ring_->RecordSlot(slot, stream)
        .With("record the snapshot's CUDA event on its stream (a stream of device " + Device() + "?)");
  }

  Status SynchronizeDevice() const override {
    CurrentDeviceGuard guard;
    if (Status s = cuda::CudaStatus(::cudaSetDevice(plan_.device), "cudaSetDevice"); !s.ok()) return s;
    return cuda::CudaStatus(::cudaDeviceSynchronize(), "cudaDeviceSynchronize before restore");
  }

  Result<std::shared_ptr<const void>> MapReleaseWords(void* words, std::size_t bytes) override {
    const auto& driver = cuda::Driver();
    if (!driver.ok()) return driver.status();
    if (driver->cuStreamWaitValue32 == nullptr) {
      return FailedPrecondition("the CUDA driver provides no cuStreamWaitValue32");
    }
    CurrentDeviceGuard guard;
    if (Status s = cuda::CudaStatus(::cudaSetDevice(plan_.device), "cudaSetDevice"); !s.ok()) return s;
    if (Status s = cuda::CudaStatus(
            ::cudaHostRegister(words, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
            "cudaHostRegister (release words)");
        !s.ok()) {
      return s;
    }
    return std::shared_ptr<const void>(words, [](void* p) { (void)::cudaHostUnregister(p); });
  }

  Result<bool> WaitReleaseWord(const void* word, std::uint32_t value, void* stream) override {
    const auto& driver = cuda::Driver();
    if (!driver.ok()) return driver.status();
    CurrentDeviceGuard guard;
    if (Status s = cuda::CudaStatus(::cudaSetDevice(plan_.device), "cudaSetDevice"); !s.ok()) return s;
    void* address = nullptr;
    if (Status s = cuda::CudaStatus(::cudaHostGetDevicePointer(&address, const_cast<void*>(word), 0),
                                    "cudaHostGetDevicePointer (release word)");
        !s.ok()) {
      return s;
    }
    const CUresult r =
        driver->cuStreamWaitValue32(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                                    value, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_ERROR_NOT_SUPPORTED) return false;
    if (Status s = driver->Check(r, "cuStreamWaitValue32 (release word)"); !s.ok()) {
      return s.With("make the stream wait on the release word (a stream of device " + Device() + "?)");
    }
    return true;
  }

  Status WaitDaemonEvent(std::uint32_t slot, void* stream) override {
    if (!daemon_ring_) {
      return FailedPrecondition("the daemon answered with its CUDA event " + std::to_string(slot) +
                                " but sent no event ring at registration");
    }
    CurrentDeviceGuard guard;
    return daemon_ring_->WaitSlot(slot, stream)
        .With("make the stream wait on the daemon's CUDA event (a stream of device " + Device() + "?)");
  }

 private:
  std::string Device() const { return std::to_string(plan_.device); }

  cuda::AllocationPlan plan_;
  std::string device_uuid_;
  std::vector<CudaTableRow> rows_;
  // Shared with the registration this one replaced (same session, same device), which a
  // concurrent call may still hold.
  std::shared_ptr<cuda::EventRing> trainer_ring_;
  std::shared_ptr<cuda::EventRing> daemon_ring_;
};

}  // namespace

Result<std::shared_ptr<CudaTensors>> ResolveCudaTensors(const std::vector<CudaTensorSpec>& tensors) {
  if (tensors.empty()) return InvalidArgument("no GPU tensors to register");
  const auto& driver = cuda::Driver();
  if (!driver.ok()) return driver.status().With("GPU tensor '" + tensors.front().name + "'");

  std::vector<cuda::TensorPointer> pointers;
  pointers.reserve(tensors.size());
  for (const CudaTensorSpec& t : tensors) {
    const auto address = reinterpret_cast<std::uint64_t>(t.ptr);
    auto attributes = cuda::QueryPointerAttributes(driver.value(), address);
    if (!attributes.ok()) return attributes.status().With("GPU tensor '" + t.name + "'");
    pointers.push_back(cuda::TensorPointer{t.name, address, t.bytes, attributes.value()});
  }
  auto plan = cuda::PlanAllocations(pointers);
  if (!plan.ok()) return plan.status();

  CurrentDeviceGuard guard;
  const int device = plan.value().device;
  cudaDeviceProp prop{};
  if (Status s = cuda::CudaStatus(::cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
      !s.ok()) {
    return s.With("GPU tensor '" + tensors.front().name + "' on device " + std::to_string(device));
  }
  cuda::DeviceUuid uuid;
  static_assert(sizeof(prop.uuid.bytes) == sizeof(uuid.bytes));
  std::memcpy(uuid.bytes.data(), prop.uuid.bytes, uuid.bytes.size());
  if (Status s = cuda::CudaStatus(::cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;

  // One export per allocation: caching allocators put many tensors in one cudaMalloc block.
  std::vector<std::string> regions;
  for (const cuda::Allocation& a : plan.value().allocations) {
    cudaIpcMemHandle_t h;
    Status s =
        cuda::CudaStatus(::cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(a.base)), "cudaIpcGetMemHandle");
    if (!s.ok()) {
      return s.With("export the allocation of GPU tensor '" + a.first_tensor + "' (" +
                    cuda::HexAddress(a.base) + ", " + std::to_string(a.size) + " bytes)");
    }
    cuda::CudaRegionRef ref;
    ref.device = uuid;
    std::memcpy(ref.handle.bytes.data(), h.reserved, ref.handle.bytes.size());
    regions.push_back(cuda::FormatCudaRegionName(ref));
  }

  std::vector<CudaTableRow> rows;
  rows.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::size_t a = plan.value().allocation_of[i];
    rows.push_back(
        CudaTableRow{regions[a], plan.value().offset_of[i], plan.value().allocations[a].buffer_id});
  }
  return std::shared_ptr<CudaTensors>(
      std::make_shared<CudaTensorsImpl>(std::move(plan).value(), uuid.Hex(), std::move(rows)));
}

}  // namespace ckpt
