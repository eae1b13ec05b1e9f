#include "cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <string_view>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "cuda/cuda_error.h"
#include "cuda/cuda_importer.h"
#include "cuda/device_releaser.h"
#include "cuda/driver_api.h"
#include "cuda/lane_watch.h"
#include "cuda/region_name.h"
#include "cuda/release_word_writer.h"

namespace ckpt::cuda {
namespace {

// ---- copy lanes -------------------------------------------------------------------------

// One daemon stream. Each chunk ends with an event; waiting for a chunk synchronises on
// it. The device spans of queued copies are held until their chunk is waited for, so an
// allocation cannot be closed under a running copy. Every call sets the lane's device
// first: the engine's threads serve many devices, and the current device is per thread.
// The lane tells the LaneWatch when it is gated on a trainer's event and when that event
// has fired, so that closes on its device are put off while it waits on a dead trainer.
class CudaCopyLane final : public CopyLane {
 public:
  CudaCopyLane(CopyStreamPool::Lease lease, int device, std::shared_ptr<LaneWatch> watch)
      : lease_(std::move(lease)), device_(device), watch_(std::move(watch)) {
    cudaStream_t stream = lease_.stream();
    watch_id_ = watch_->Add(device_, [stream] { return ::cudaStreamQuery(stream) != cudaErrorNotReady; });
  }
  // The engine destroys a lane once it is idle, or drained (everything waited for, so only
  // the completion event's record may still be queued).
  ~CudaCopyLane() override {
    watch_->Remove(watch_id_);
    if (::cudaSetDevice(device_) != cudaSuccess) return;
    (void)::cudaStreamSynchronize(lease_.stream());
    for (auto& p : pending_) free_.push_back(p.event);
    for (cudaEvent_t e : free_) (void)::cudaEventDestroy(e);
  }
  CudaCopyLane(const CudaCopyLane&) = delete;
  CudaCopyLane& operator=(const CudaCopyLane&) = delete;

  bool synchronous() const override { return false; }
  void* native() const override { return lease_.stream(); }

  // The lane's next copies wait on an event of the trainer whose exit sets `trainer_gone`.
  void Gated(std::shared_ptr<const std::atomic<bool>> trainer_gone) {
    watch_->Gated(watch_id_, std::move(trainer_gone));
  }

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
    if (Status s = SetDevice(); !s.ok()) return s;
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
    if (Status s = SetDevice(); !s.ok()) return s;
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
      // Copies queued after the gate ran: the trainer's event fired.
      if (out.ok()) watch_->Flowing(watch_id_);
    }
    return out;
  }

  bool Idle() override { return ::cudaStreamQuery(lease_.stream()) != cudaErrorNotReady; }

  Status After(CopyLane& other) override {
    auto* other_stream = static_cast<cudaStream_t>(other.native());
    if (other_stream == nullptr || other_stream == lease_.stream()) return Status::Ok();
    // Both streams are on this lane's device (one shard's lanes share it).
    if (Status s = SetDevice(); !s.ok()) return s;
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
    if (Status s = SetDevice(); !s.ok()) return s;
    if (Status s = enqueue(span->ptr); !s.ok()) return s;
    keeps_.push_back(std::move(span->keep));
    return Status::Ok();
  }

  struct Pending {
    std::uint64_t ticket;
    cudaEvent_t event;
    std::vector<std::shared_ptr<const void>> keeps;
  };
  Status SetDevice() const { return CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); }

  CopyStreamPool::Lease lease_;
  int device_;
  std::shared_ptr<LaneWatch> watch_;
  LaneWatch::Id watch_id_ = 0;
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
  std::unique_ptr<ReleaseWordWriter> words;  // null: events only
  int device = -1;
  // Set when the trainer exits (DeviceBackend::ReleaseClient): lanes gated on its events
  // may never run again.
  std::shared_ptr<std::atomic<bool>> trainer_gone = std::make_shared<std::atomic<bool>>(false);
  Mutex mu;
  std::uint64_t sequence = 0;  // versions begun, the daemon ring's assignment order
};

// The value the session's `sequence`-th version writes into its release word: above the
// session's base, modulo 2^32 (cyclic), never 0 (the words' initial value).
std::uint32_t ReleaseValue(const EventState& state, std::uint64_t sequence) {
  if (!state.words) return 0;
  const auto value = static_cast<std::uint32_t>(state.words->base() + sequence);
  return value == 0 ? 1 : value;
}

class CudaVersionSync final : public VersionSync {
 public:
  CudaVersionSync(std::shared_ptr<EventState> state, std::uint64_t sequence, std::uint32_t trainer_slot,
                  std::uint32_t daemon_slot)
      : state_(std::move(state)),
        sequence_(sequence),
        trainer_slot_(trainer_slot),
        daemon_slot_(daemon_slot),
        release_value_(ReleaseValue(*state_, sequence)) {}
  ~CudaVersionSync() override { Release(); }

  Status Gate(CopyLane& lane) override {
    if (auto* cuda_lane = dynamic_cast<CudaCopyLane*>(&lane)) {
      if (Status s = CudaStatus(::cudaSetDevice(state_->device), "cudaSetDevice"); !s.ok()) return s;
      cuda_lane->Gated(state_->trainer_gone);
    }
    return state_->trainer->WaitSlot(trainer_slot_, lane.native());
  }

  Status Signal(const std::vector<CopyLane*>& lanes) override {
    if (lanes.empty()) return InvalidArgument("no copy lane to record the completion event on");
    if (dynamic_cast<CudaCopyLane*>(lanes[0]) != nullptr) {
      if (Status s = CudaStatus(::cudaSetDevice(state_->device), "cudaSetDevice"); !s.ok()) return s;
    }
    for (std::size_t i = 1; i < lanes.size(); ++i) {
      if (Status s = lanes[0]->After(*lanes[i]); !s.ok()) return s;
    }
    // The word's slot is the event's: it is written again only once this version is
    // released (its lanes, synchronised on destruction, are gone by then) and superseded,
    // so a word's values only grow.
    if (state_->words) {
      if (Status s = state_->words->Write(lanes[0]->native(), daemon_slot_, release_value_); !s.ok())
        return s;
    }
    return state_->daemon->RecordSlot(daemon_slot_, lanes[0]->native());
  }

  std::optional<std::uint32_t> release_value() const override {
    if (!state_->words) return std::nullopt;
    return release_value_;
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
  std::uint32_t release_value_;
  std::atomic<bool> released_{false};
};

class CudaSessionEvents final : public SessionEvents {
 public:
  explicit CudaSessionEvents(std::shared_ptr<EventState> state) : state_(std::move(state)) {}

  int device() const override { return state_->device; }

  bool writes_release_words() const override { return state_->words != nullptr; }

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
        watch_(std::make_shared<LaneWatch>()),
        releaser_(std::make_shared<DeviceReleaser>(
            [watch = watch_](int device) { return watch->Abandoned(device); })),
        cache_(std::make_shared<IpcHandleCache>(
            std::make_shared<ReleasingOpener>(std::make_shared<CudaIpcOpener>(), releaser_))),
        streams_(std::make_shared<CopyStreamPool>()) {}

  // The mappings go first (their closes are posted), then the releaser runs what it can in
  // its grace period; the streams are destroyed last.
  ~CudaBackend() override {
    cache_.reset();
    releaser_->Stop(std::chrono::steady_clock::now() + DeviceReleaser::kStopGrace);
  }

  std::string Describe() const override { return description_; }

  bool Owns(std::string_view region_name) const override { return IsCudaRegionName(region_name); }

  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, pid_t pid,
                                                 std::uint64_t min_size) override {
    return CudaIpcImporter(cache_, streams_, pid).Import(name, 0, min_size);
  }

  void ReleaseClient(pid_t pid) override {
    {
      MutexLock lock(mu_);
      auto [first, last] = trainer_gone_.equal_range(pid);
      for (auto it = first; it != last; ++it) {
        if (auto gone = it->second.lock()) *gone = true;
      }
      trainer_gone_.erase(first, last);
    }
    // After the flags: a close this posts is put off if a lane waits on this trainer.
    cache_->ReleaseClient(pid);
  }

  Status AwaitReleases(std::chrono::steady_clock::time_point deadline) override {
    return releaser_->AwaitPosted(deadline);
  }

  Result<std::unique_ptr<SessionEvents>> OpenSession(pid_t pid, const std::string& device_uuid,
                                                     const std::vector<std::string>& trainer_events,
                                                     const TrainerReleaseWords* release_words) override {
    auto uuid = DeviceUuid::Parse(device_uuid);
    if (!uuid.ok()) return uuid.status();
    auto device = DeviceOrdinalForUuid(uuid.value());
    if (!device.ok()) return device.status();
    std::unique_ptr<ReleaseWordWriter> words;
    if (release_words != nullptr) {
      auto made = MakeCudaReleaseWordWriter(device.value(), *release_words, releaser_);
      if (made.ok()) {
        words = std::move(made).value();
      } else {
        spdlog::info(
            "GPU {}: the trainer's release words cannot be written ({}); its stream-ordered waits "
            "use the daemon's events",
            device_uuid, made.status().message());
      }
    }
    auto gone = std::make_shared<std::atomic<bool>>(false);
    auto events = MakeSessionEvents(MakeCudaEventFactory(device.value()), device.value(), trainer_events,
                                    kDaemonEventSlots, gone, std::move(words));
    if (!events.ok()) return events.status();
    MutexLock lock(mu_);
    for (auto it = trainer_gone_.begin(); it != trainer_gone_.end();) {
      it = it->second.expired() ? trainer_gone_.erase(it) : std::next(it);
    }
    trainer_gone_.emplace(pid, gone);
    return events;
  }

  Result<std::vector<std::unique_ptr<CopyLane>>> MakeLanes(int device, std::uint32_t count) override {
    std::vector<std::unique_ptr<CopyLane>> lanes;
    for (std::uint32_t i = 0; i < count; ++i) {
      auto lease = streams_->Borrow(device);
      if (!lease.ok()) return lease.status();
      lanes.push_back(std::make_unique<CudaCopyLane>(std::move(lease).value(), device, watch_));
    }
    return lanes;
  }

  Status Pin(void* base, std::size_t bytes, int numa_node) override {
    // The registration needs a context, and creates the primary context of the thread's
    // current device. That device is chosen here, not left to whatever the thread had (or
    // GPU 0 by default): the first GPU whose nearest host node holds the pool. Portable
    // memory is pinned for every context, so the choice only decides where that context is.
    const int device = PinDevice(numa_node);
    if (Status s = CudaStatus(::cudaSetDevice(device), "cudaSetDevice (host pool)"); !s.ok()) return s;
    if (Status s = CudaStatus(::cudaHostRegister(base, bytes, cudaHostRegisterPortable),
                              "cudaHostRegister (host pool)");
        !s.ok()) {
      return s;
    }
    pin_device_ = device;
    spdlog::info(
        "host pool page-locked (portable) through GPU {}{}", device,
        numa_node >= 0 ? " (nearest NUMA node " + std::to_string(numa_node) + " searched)" : std::string());
    return Status::Ok();
  }

  void Unpin(void* base) override {
    // On the releaser: cudaHostUnregister may synchronise behind a stuck stream, and is put
    // off (left to the process exit) while a lane waits on a dead trainer's event.
    releaser_->Post(-1, [base, device = pin_device_] {
      if (::cudaSetDevice(device) == cudaSuccess) (void)::cudaHostUnregister(base);
    });
    if (Status s = releaser_->AwaitPosted(std::chrono::steady_clock::now() + DeviceReleaser::kStopGrace);
        !s.ok()) {
      spdlog::warn("host pool not unpinned at shutdown: {}", s.message());
    }
  }

 private:
  // The first device whose nearest host NUMA node is `numa_node`; 0 if none is (or unknown).
  static int PinDevice(int numa_node) {
    const auto& driver = Driver();
    if (numa_node < 0 || !driver.ok()) return 0;
    for (int d = 0; d < driver->device_count; ++d) {
      int node = -1;
      if (::cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, d) == cudaSuccess && node == numa_node)
        return d;
    }
    return 0;
  }

  std::string description_;
  int pin_device_ = 0;  // set by Pin, before any thread could Unpin
  std::shared_ptr<LaneWatch> watch_;
  std::shared_ptr<DeviceReleaser> releaser_;
  std::shared_ptr<IpcHandleCache> cache_;
  std::shared_ptr<CopyStreamPool> streams_;
  Mutex mu_;
  // The trainer-exit flag of each session's events, by client pid.
  std::multimap<pid_t, std::weak_ptr<std::atomic<bool>>> trainer_gone_ GUARDED_BY(mu_);
};

}  // namespace

Result<std::unique_ptr<SessionEvents>> MakeSessionEvents(std::unique_ptr<IpcEventFactory> factory, int device,
                                                         const std::vector<std::string>& trainer_handles,
                                                         std::uint32_t daemon_slots,
                                                         std::shared_ptr<std::atomic<bool>> trainer_gone,
                                                         std::unique_ptr<ReleaseWordWriter> words) {
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
  if (trainer_gone) state->trainer_gone = std::move(trainer_gone);
  state->factory = std::move(factory);
  auto trainer = EventRing::Open(handles, *state->factory);
  if (!trainer.ok()) return trainer.status().With("trainer event ring");
  state->trainer = std::move(trainer).value();
  auto daemon = EventRing::Create(daemon_slots, *state->factory);
  if (!daemon.ok()) return daemon.status().With("daemon event ring");
  state->daemon = std::move(daemon).value();
  // One word per daemon slot, or none at all.
  if (words && words->count() >= daemon_slots) state->words = std::move(words);
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
