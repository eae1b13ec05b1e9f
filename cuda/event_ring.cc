#include "cuda/event_ring.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "cuda/cuda_error.h"

namespace ckpt::cuda {

// ---- EventSlotRing ----------------------------------------------------------------------

Result<std::unique_ptr<EventSlotRing>> EventSlotRing::Create(std::uint32_t slots) {
  if (slots == 0 || slots > 1024) {
    return InvalidArgument("an event ring has 1 to 1024 slots, not " + std::to_string(slots));
  }
  return std::unique_ptr<EventSlotRing>(new EventSlotRing(slots));
}

std::uint32_t EventSlotRing::next_slot() const {
  MutexLock lock(mu_);
  return static_cast<std::uint32_t>(assigned_ % slots_.size());
}

std::optional<std::uint64_t> EventSlotRing::BlockingVersion() const {
  MutexLock lock(mu_);
  const Slot& s = slots_[assigned_ % slots_.size()];
  if (s.used && !(s.captured && s.acked)) return s.version;
  return std::nullopt;
}

Result<std::uint32_t> EventSlotRing::Assign(std::uint64_t version) {
  MutexLock lock(mu_);
  if (last_version_ && version <= *last_version_) {
    return FailedPrecondition("version " + std::to_string(version) + " does not follow version " +
                              std::to_string(*last_version_) + " in the event ring");
  }
  const auto index = static_cast<std::uint32_t>(assigned_ % slots_.size());
  Slot& s = slots_[index];
  if (s.used && !(s.captured && s.acked)) {
    return ResourceExhausted("event slot " + std::to_string(index) + " still belongs to version " +
                             std::to_string(s.version) + ", which is not yet " +
                             (s.captured ? "acknowledged by the client" : "captured by the daemon") +
                             "; all " + std::to_string(slots_.size()) + " slots are in use");
  }
  s = Slot{true, version, false, false};
  ++assigned_;
  last_version_ = version;
  return index;
}

Result<std::uint32_t> EventSlotRing::FindLocked(std::uint64_t version) const {
  for (std::uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].used && slots_[i].version == version) return i;
  }
  return NotFound("version " + std::to_string(version) + " holds no event slot");
}

Result<std::uint32_t> EventSlotRing::SlotOf(std::uint64_t version) const {
  MutexLock lock(mu_);
  return FindLocked(version);
}

Status EventSlotRing::MarkCaptured(std::uint64_t version) {
  MutexLock lock(mu_);
  auto slot = FindLocked(version);
  if (!slot.ok()) return slot.status();
  slots_[slot.value()].captured = true;
  return Status::Ok();
}

Status EventSlotRing::Acknowledge(std::uint64_t version) {
  MutexLock lock(mu_);
  auto slot = FindLocked(version);
  if (!slot.ok()) return slot.status();
  slots_[slot.value()].acked = true;
  return Status::Ok();
}

void EventSlotRing::AcknowledgeThrough(std::uint64_t version) {
  MutexLock lock(mu_);
  for (Slot& s : slots_) {
    if (s.used && s.version <= version) s.acked = true;
  }
}

bool EventSlotRing::Reusable(std::uint32_t slot) const {
  MutexLock lock(mu_);
  if (slot >= slots_.size()) return false;
  const Slot& s = slots_[slot];
  return !s.used || (s.captured && s.acked);
}

// ---- EventRing --------------------------------------------------------------------------

Result<std::unique_ptr<EventRing>> EventRing::Create(std::uint32_t slots, IpcEventFactory& factory) {
  auto ring = EventSlotRing::Create(slots);
  if (!ring.ok()) return ring.status();
  std::unique_ptr<EventRing> out(new EventRing());
  out->slots_ = std::move(ring).value();
  for (std::uint32_t i = 0; i < slots; ++i) {
    auto event = factory.Create();
    if (!event.ok()) return event.status().With("create event " + std::to_string(i) + " of the ring");
    out->events_.push_back(std::move(event).value());
  }
  return out;
}

Result<std::unique_ptr<EventRing>> EventRing::Open(const std::vector<IpcHandle>& handles,
                                                   IpcEventFactory& factory) {
  auto ring = EventSlotRing::Create(static_cast<std::uint32_t>(handles.size()));
  if (!ring.ok()) return ring.status();
  std::unique_ptr<EventRing> out(new EventRing());
  out->slots_ = std::move(ring).value();
  for (std::size_t i = 0; i < handles.size(); ++i) {
    auto event = factory.Open(handles[i]);
    if (!event.ok()) return event.status().With("open event " + std::to_string(i) + " of the ring");
    out->events_.push_back(std::move(event).value());
  }
  return out;
}

std::vector<IpcHandle> EventRing::handles() const {
  std::vector<IpcHandle> out;
  for (const auto& e : events_) out.push_back(e->handle());
  return out;
}

Result<std::uint32_t> EventRing::RecordVersion(std::uint64_t version, void* stream) {
  auto slot = slots_->Assign(version);
  if (!slot.ok()) return slot.status();
  if (Status s = events_[slot.value()]->Record(stream); !s.ok()) {
    return s.With("record the event of version " + std::to_string(version));
  }
  return slot;
}

Status EventRing::WaitVersion(std::uint64_t version, void* stream) {
  auto slot = slots_->SlotOf(version);
  if (!slot.ok()) return slot.status();
  return events_[slot.value()]->StreamWait(stream).With("wait on the event of version " +
                                                        std::to_string(version));
}

namespace {
Status BadSlot(std::uint32_t slot, std::size_t size) {
  return InvalidArgument("event slot " + std::to_string(slot) + " is outside the ring of " +
                         std::to_string(size) + " events");
}
}  // namespace

Status EventRing::RecordSlot(std::uint32_t slot, void* stream) {
  if (slot >= events_.size()) return BadSlot(slot, events_.size());
  return events_[slot]->Record(stream).With("record event slot " + std::to_string(slot));
}

Status EventRing::WaitSlot(std::uint32_t slot, void* stream) {
  if (slot >= events_.size()) return BadSlot(slot, events_.size());
  return events_[slot]->StreamWait(stream).With("wait on event slot " + std::to_string(slot));
}

Status EventRing::SynchronizeSlot(std::uint32_t slot) {
  if (slot >= events_.size()) return BadSlot(slot, events_.size());
  return events_[slot]->Synchronize().With("synchronize event slot " + std::to_string(slot));
}

// ---- CUDA events ------------------------------------------------------------------------

namespace {

static_assert(sizeof(cudaIpcEventHandle_t) == IpcHandle::kBytes);

class CudaIpcEvent : public IpcEvent {
 public:
  CudaIpcEvent(int device, cudaEvent_t event, const IpcHandle& handle)
      : device_(device), event_(event), handle_(handle) {}
  ~CudaIpcEvent() override {
    if (::cudaSetDevice(device_) == cudaSuccess) (void)::cudaEventDestroy(event_);
  }
  CudaIpcEvent(const CudaIpcEvent&) = delete;
  CudaIpcEvent& operator=(const CudaIpcEvent&) = delete;

  Status Record(void* stream) override {
    if (Status s = CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    return CudaStatus(::cudaEventRecord(event_, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  }
  Status StreamWait(void* stream) override {
    if (Status s = CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    return CudaStatus(::cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0),
                      "cudaStreamWaitEvent");
  }
  Status Synchronize() override { return CudaStatus(::cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  const IpcHandle& handle() const override { return handle_; }

 private:
  int device_;
  cudaEvent_t event_;
  IpcHandle handle_;
};

class CudaEventFactory : public IpcEventFactory {
 public:
  explicit CudaEventFactory(int device) : device_(device) {}

  Result<std::unique_ptr<IpcEvent>> Create() override {
    if (Status s = CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    cudaEvent_t event = nullptr;
    Status s = CudaStatus(::cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming),
                          "cudaEventCreateWithFlags(interprocess)");
    if (!s.ok()) return s;
    cudaIpcEventHandle_t h;
    s = CudaStatus(::cudaIpcGetEventHandle(&h, event), "cudaIpcGetEventHandle");
    if (!s.ok()) {
      (void)::cudaEventDestroy(event);
      return s;
    }
    IpcHandle handle;
    std::memcpy(handle.bytes.data(), h.reserved, IpcHandle::kBytes);
    return std::unique_ptr<IpcEvent>(new CudaIpcEvent(device_, event, handle));
  }

  Result<std::unique_ptr<IpcEvent>> Open(const IpcHandle& handle) override {
    if (Status s = CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    cudaIpcEventHandle_t h;
    std::memcpy(h.reserved, handle.bytes.data(), IpcHandle::kBytes);
    cudaEvent_t event = nullptr;
    if (Status s = CudaStatus(::cudaIpcOpenEventHandle(&event, h), "cudaIpcOpenEventHandle"); !s.ok()) {
      return s;
    }
    return std::unique_ptr<IpcEvent>(new CudaIpcEvent(device_, event, handle));
  }

 private:
  int device_;
};

}  // namespace

std::unique_ptr<IpcEventFactory> MakeCudaEventFactory(int device) {
  return std::make_unique<CudaEventFactory>(device);
}

}  // namespace ckpt::cuda
