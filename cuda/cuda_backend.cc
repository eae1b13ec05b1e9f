#include "cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <string_view>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "cuda/cuda_error.h"
#include "cuda/cuda_importer.h"
#include "cuda/driver_api.h"
#include "cuda/region_name.h"

namespace ckpt::cuda {
namespace {

// ---- copy lanes -------------------------------------------------------------------------

// One daemon stream. Each chunk ends with an event; waiting for a chunk synchronises on
// it. The device spans of queued copies are held until their chunk is waited for, so an
// allocation cannot be closed under a running copy.
class CudaCopyLane final : public CopyLane {
 public:
  CudaCopyLane(CopyStreamPool::Lease lease, int device) : lease_(std::move(lease)), device_(device) {}
  // The engine destroys a lane once it is idle, or drained (everything waited for, so only
  // the completion event's record may still be queued).
  ~CudaCopyLane() override {
    if (::cudaSetDevice(device_) != cudaSuccess) return;
    (void)::cudaStreamSynchronize(lease_.stream());
    for (auto& p : pending_) free_.push_back(p.event);
    for (cudaEvent_t e : free_) (void)::cudaEventDestroy(e);
  }
  CudaCopyLane(const CudaCopyLane&) = delete;
  CudaCopyLane& operator=(const CudaCopyLane&) = delete;

  bool synchronous() const override { return false; }
  void* native() const override { return lease_.stream(); }

  Status CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) override {
    // A host region in a device shard is copied at once on this thread.
    if (region.device() < 0) return region.ReadAt(offset, dst, len);
    return Queue(region, offset, len, [&](void* device_ptr) {
      return CudaStatus(::cudaMemcpyAsync(dst, device_ptr, len, cudaMemcpyDeviceToHost, lease_.stream()),
                        "cudaMemcpyAsync device to host");
    });
  }

  Status CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src,
                std::size_t len) override {
    if (region.device() < 0) return region.WriteAt(offset, src, len);
    return Queue(region, offset, len, [&](void* device_ptr) {
      return CudaStatus(::cudaMemcpyAsync(device_ptr, src, len, cudaMemcpyHostToDevice, lease_.stream()),
                        "cudaMemcpyAsync host to device");
    });
  }

  Result<std::uint64_t> EndChunk() override {
    cudaEvent_t event = nullptr;
    if (!free_.empty()) {
      event = free_.back();
      free_.pop_back();
    } else if (Status s =
                   CudaStatus(::cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
               !s.ok()) {
      return s;
    }
    if (Status s = CudaStatus(::cudaEventRecord(event, lease_.stream()), "cudaEventRecord"); !s.ok()) {
      free_.push_back(event);
      return s;
    }
    pending_.push_back(Pending{++tickets_, event, std::move(keeps_)});
    keeps_.clear();
    return tickets_;
  }

  Status WaitChunk(std::uint64_t ticket, const std::function<bool()>& give_up) override {
    Status out;
    while (!pending_.empty() && pending_.front().ticket <= ticket) {
      Pending& p = pending_.front();
      // Polled rather than cudaEventSynchronize: that cannot be interrupted if the event
      // never fires (the trainer whose event gates the copies died), and it spins a core.
      for (int polls = 0;; ++polls) {
        const cudaError_t r = ::cudaEventQuery(p.event);
        if (r == cudaSuccess) break;
        if (r != cudaErrorNotReady) {
          if (out.ok()) out = CudaStatus(r, "device-to-host copy (cudaEventQuery)");
          break;
        }
        if (give_up()) {
          // The chunk stays pending (with its device spans): its copies may still run.
          return FailedPrecondition("device-to-host copies abandoned before they ran");
        }
        // A 16-64 MiB chunk takes about a millisecond on the copy engines.
        std::this_thread::sleep_for(polls < 50 ? std::chrono::microseconds(20)
                                               : std::chrono::microseconds(200));
      }
      free_.push_back(p.event);
      pending_.pop_front();
    }
    return out;
  }

  bool Idle() override { return ::cudaStreamQuery(lease_.stream()) != cudaErrorNotReady; }

  Status After(CopyLane& other) override {
    auto* other_stream = static_cast<cudaStream_t>(other.native());
    if (other_stream == nullptr || other_stream == lease_.stream()) return Status::Ok();
    cudaEvent_t event = nullptr;
    if (Status s = CudaStatus(::cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
        !s.ok()) {
      return s;
    }
    Status s = CudaStatus(::cudaEventRecord(event, other_stream), "cudaEventRecord");
    if (s.ok()) s = CudaStatus(::cudaStreamWaitEvent(lease_.stream(), event, 0), "cudaStreamWaitEvent");
    (void)::cudaEventDestroy(event);  // released once the wait no longer needs it
    return s;
  }

 private:
  // Checks that `region` is on this lane's device, takes its device span and queues one
  // copy of it with `enqueue`; the span is held until the chunk is waited for.
  template <typename Enqueue>
  Status Queue(const ImportedRegion& region, std::uint64_t offset, std::size_t len, Enqueue enqueue) {
    if (region.device() != device_) {
      return FailedPrecondition("region " + region.name().substr(0, 40) + "... is on device " +
                                std::to_string(region.device()) + ", not on the lane's device " +
                                std::to_string(device_));
    }
    auto span = region.DeviceAt(offset, len);
    if (!span.ok()) return span.status();
    if (len == 0) return Status::Ok();
    if (Status s = enqueue(span->ptr); !s.ok()) return s;
    keeps_.push_back(std::move(span->keep));
    return Status::Ok();
  }

  struct Pending {
    std::uint64_t ticket;
    cudaEvent_t event;
    std::vector<std::shared_ptr<const void>> keeps;
  };
  CopyStreamPool::Lease lease_;
  int device_;
  std::uint64_t tickets_ = 0;
  std::vector<std::shared_ptr<const void>> keeps_;  // of the chunk being queued
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_;
};

// ---- session events ---------------------------------------------------------------------

struct EventState {
  std::unique_ptr<IpcEventFactory> factory;  // outlives the rings' events
  std::unique_ptr<EventRing> trainer;
  std::unique_ptr<EventRing> daemon;
  int device = -1;
  Mutex mu;
  std::uint64_t sequence = 0;  // versions begun, the daemon ring's assignment order
};

class CudaVersionSync final : public VersionSync {
 public:
  CudaVersionSync(std::shared_ptr<EventState> state, std::uint64_t sequence, std::uint32_t trainer_slot,
                  std::uint32_t daemon_slot)
      : state_(std::move(state)),
        sequence_(sequence),
        trainer_slot_(trainer_slot),
        daemon_slot_(daemon_slot) {}
  ~CudaVersionSync() override { Release(); }

  Status Gate(CopyLane& lane) override { return state_->trainer->WaitSlot(trainer_slot_, lane.native()); }

  Status Signal(const std::vector<CopyLane*>& lanes) override {
    if (lanes.empty()) return InvalidArgument("no copy lane to record the completion event on");
    for (std::size_t i = 1; i < lanes.size(); ++i) {
      if (Status s = lanes[0]->After(*lanes[i]); !s.ok()) return s;
    }
    return state_->daemon->RecordSlot(daemon_slot_, lanes[0]->native());
  }

  void Release() override {
    if (!released_.exchange(true)) (void)state_->daemon->slots().MarkCaptured(sequence_);
  }

  std::uint32_t daemon_slot() const override { return daemon_slot_; }

 private:
  std::shared_ptr<EventState> state_;
  std::uint64_t sequence_;
  std::uint32_t trainer_slot_;
  std::uint32_t daemon_slot_;
  std::atomic<bool> released_{false};
};

class CudaSessionEvents final : public SessionEvents {
 public:
  explicit CudaSessionEvents(std::shared_ptr<EventState> state) : state_(std::move(state)) {}

  int device() const override { return state_->device; }

  std::vector<std::string> daemon_handles() const override {
    std::vector<std::string> out;
    for (const IpcHandle& h : state_->daemon->handles()) {
      out.emplace_back(reinterpret_cast<const char*>(h.bytes.data()), h.bytes.size());
    }
    return out;
  }

  Result<std::shared_ptr<VersionSync>> Begin(std::uint64_t version, std::uint32_t trainer_slot) override {
    if (trainer_slot >= state_->trainer->size()) {
      return InvalidArgument("trainer event slot " + std::to_string(trainer_slot) +
                             " is outside its ring of " + std::to_string(state_->trainer->size()) +
                             " events");
    }
    MutexLock lock(state_->mu);
    const std::uint64_t sequence = ++state_->sequence;
    // A new snapshot means the trainer makes no more stream waits on earlier versions.
    state_->daemon->slots().AcknowledgeThrough(sequence - 1);
    auto slot = state_->daemon->slots().Assign(sequence);
    if (!slot.ok()) {
      --state_->sequence;
      return slot.status().With("daemon event ring (version " + std::to_string(version) + ")");
    }
    return std::shared_ptr<VersionSync>(
        std::make_shared<CudaVersionSync>(state_, sequence, trainer_slot, slot.value()));
  }

 private:
  std::shared_ptr<EventState> state_;
};

// ---- backend ----------------------------------------------------------------------------

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(std::string description)
      : description_(std::move(description)),
        cache_(std::make_shared<IpcHandleCache>(std::make_shared<CudaIpcOpener>())),
        streams_(std::make_shared<CopyStreamPool>()) {}

  std::string Describe() const override { return description_; }

  bool Owns(std::string_view region_name) const override { return IsCudaRegionName(region_name); }

  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, pid_t pid,
                                                 std::uint64_t min_size) override {
    return CudaIpcImporter(cache_, streams_, pid).Import(name, 0, min_size);
  }

  void ReleaseClient(pid_t pid) override { cache_->ReleaseClient(pid); }

  Result<std::unique_ptr<SessionEvents>> OpenSession(
      const std::string& device_uuid, const std::vector<std::string>& trainer_events) override {
    auto uuid = DeviceUuid::Parse(device_uuid);
    if (!uuid.ok()) return uuid.status();
    auto device = DeviceOrdinalForUuid(uuid.value());
    if (!device.ok()) return device.status();
    return MakeSessionEvents(MakeCudaEventFactory(device.value()), device.value(), trainer_events);
  }

  Result<std::vector<std::unique_ptr<CopyLane>>> MakeLanes(int device, std::uint32_t count) override {
    std::vector<std::unique_ptr<CopyLane>> lanes;
    for (std::uint32_t i = 0; i < count; ++i) {
      auto lease = streams_->Borrow(device);
      if (!lease.ok()) return lease.status();
      lanes.push_back(std::make_unique<CudaCopyLane>(std::move(lease).value(), device));
    }
    return lanes;
  }

  Status Pin(void* base, std::size_t bytes) override {
    return CudaStatus(::cudaHostRegister(base, bytes, cudaHostRegisterPortable),
                      "cudaHostRegister (host pool)");
  }

  void Unpin(void* base) override { (void)::cudaHostUnregister(base); }

 private:
  std::string description_;
  std::shared_ptr<IpcHandleCache> cache_;
  std::shared_ptr<CopyStreamPool> streams_;
};

}  // namespace

Result<std::unique_ptr<SessionEvents>> MakeSessionEvents(std::unique_ptr<IpcEventFactory> factory, int device,
                                                         const std::vector<std::string>& trainer_handles,
                                                         std::uint32_t daemon_slots) {
  if (trainer_handles.empty()) return InvalidArgument("the trainer sent no event handles");
  std::vector<IpcHandle> handles;
  for (std::size_t i = 0; i < trainer_handles.size(); ++i) {
    const std::string& h = trainer_handles[i];
    if (h.size() != IpcHandle::kBytes) {
      return InvalidArgument("trainer event handle " + std::to_string(i) + " is " + std::to_string(h.size()) +
                             " bytes, not " + std::to_string(IpcHandle::kBytes));
    }
    IpcHandle handle;
    std::copy(h.begin(), h.end(), reinterpret_cast<char*>(handle.bytes.data()));
    handles.push_back(handle);
  }
  auto state = std::make_shared<EventState>();
  state->device = device;
  state->factory = std::move(factory);
  auto trainer = EventRing::Open(handles, *state->factory);
  if (!trainer.ok()) return trainer.status().With("trainer event ring");
  state->trainer = std::move(trainer).value();
  auto daemon = EventRing::Create(daemon_slots, *state->factory);
  if (!daemon.ok()) return daemon.status().With("daemon event ring");
  state->daemon = std::move(daemon).value();
  return std::unique_ptr<SessionEvents>(std::make_unique<CudaSessionEvents>(std::move(state)));
}

Result<std::shared_ptr<DeviceBackend>> MakeCudaBackend() {
  const auto& driver = Driver();
  if (!driver.ok()) return driver.status();
  int runtime = 0;
  (void)::cudaRuntimeGetVersion(&runtime);
  std::string text = "CUDA driver " + std::to_string(driver->driver_version / 1000) + "." +
                     std::to_string(driver->driver_version % 1000 / 10) + ", runtime " +
                     std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10) + ": " +
                     std::to_string(driver->device_count) + " device(s)";
  for (int i = 0; i < driver->device_count; ++i) {
    cudaDeviceProp prop{};
    if (Status s = CudaStatus(::cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties"); !s.ok())
      return s;
    DeviceUuid uuid;
    std::memcpy(uuid.bytes.data(), prop.uuid.bytes, uuid.bytes.size());
    text += std::string(i == 0 ? " " : ", ") + prop.name + " (" + uuid.Pretty() + ")";
  }
  return std::shared_ptr<DeviceBackend>(std::make_shared<CudaBackend>(std::move(text)));
}

}  // namespace ckpt::cuda
