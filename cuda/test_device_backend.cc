#include "cuda/test_device_backend.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_error.h"
#include "cuda/device_releaser.h"
#include "cuda/ipc_handle_cache.h"
#include "cuda/lane_watch.h"
#include "cuda/region_name.h"

namespace ckpt::cuda {
namespace {

struct Spec {
  std::string log;
  std::string block_close;
  bool sticky_copy = false;
};

Result<Spec> ParseSpec(const std::string& all) {
  Spec spec;
  std::size_t pos = 0;
  while (pos <= all.size()) {
    std::size_t end = all.find(',', pos);
    if (end == std::string::npos) end = all.size();
    const std::string field = all.substr(pos, end - pos);
    const std::size_t eq = field.find('=');
    if (eq == std::string::npos) return InvalidArgument("CKPTD_TEST_DEVICE=" + all + ": no '=' in " + field);
    const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
    if (key == "log") {
      spec.log = value;
    } else if (key == "block_close") {
      spec.block_close = value;
    } else if (key == "sticky_copy") {
      spec.sticky_copy = value == "1";
    } else {
      return InvalidArgument("CKPTD_TEST_DEVICE=" + all + ": unknown field " + key);
    }
    pos = end + 1;
  }
  if (spec.log.empty()) return InvalidArgument("CKPTD_TEST_DEVICE=" + all + ": no log=PATH");
  return spec;
}

class LogFile {
 public:
  explicit LogFile(const std::string& path)
      : fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) {}
  void Line(const std::string& text) {
    const std::string line = text + "\n";
    [[maybe_unused]] ssize_t n = ::write(fd_.get(), line.data(), line.size());
  }

 private:
  UniqueFd fd_;
};

// Opens the shared-memory object the handle names, as cudaIpcOpenMemHandle maps an allocation.
class ShmOpener final : public IpcOpener {
 public:
  ShmOpener(std::shared_ptr<LogFile> log, std::string block_close)
      : log_(std::move(log)), block_close_(std::move(block_close)) {}

  Result<IpcMapping> Open(const IpcHandle& handle, int device) override {
    const auto* bytes = reinterpret_cast<const char*>(handle.bytes.data());
    const std::string name(bytes, strnlen(bytes, handle.bytes.size()));
    UniqueFd fd(::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0));
    if (!fd.valid()) return IoError("open fake device allocation " + name, errno);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return IoError("stat " + name, errno);
    void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                     fd.get(), 0);
    if (p == MAP_FAILED) return IoError("map " + name, errno);
    log_->Line("open " + name);
    MutexLock lock(mu_);
    names_[p] = name;
    return IpcMapping{p, static_cast<std::uint64_t>(st.st_size), device};
  }

  Status Close(const IpcMapping& mapping) override {
    std::string name;
    {
      MutexLock lock(mu_);
      name = names_[mapping.base];
      names_.erase(mapping.base);
    }
    if (!block_close_.empty() && ::access(block_close_.c_str(), F_OK) == 0) {
      log_->Line("closing " + name);
      while (::access(block_close_.c_str(), F_OK) == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ::munmap(mapping.base, mapping.size);
    log_->Line("close " + name);
    return Status::Ok();
  }

 private:
  std::shared_ptr<LogFile> log_;
  const std::string block_close_;
  Mutex mu_;
  std::map<void*, std::string> names_ GUARDED_BY(mu_);
};

class TestRegion final : public ImportedRegion {
 public:
  TestRegion(std::string name, IpcHandleCache::Registration r) : name_(std::move(name)), r_(std::move(r)) {}
  const std::string& name() const override { return name_; }
  Result<std::uint64_t> CurrentSize() const override { return r_.mapping().size; }
  Status ReadAt(std::uint64_t offset, void* dst, std::size_t len) const override {
    auto span = DeviceAt(offset, len);
    if (!span.ok()) return span.status();
    std::memcpy(dst, span->ptr, len);
    return Status::Ok();
  }
  Status WriteAt(std::uint64_t offset, const void* src, std::size_t len) const override {
    auto span = DeviceAt(offset, len);
    if (!span.ok()) return span.status();
    std::memcpy(span->ptr, src, len);
    return Status::Ok();
  }
  void UnlinkIfOrphaned() const override {}
  int device() const override { return r_.mapping().device; }
  Result<DeviceSpan> DeviceAt(std::uint64_t offset, std::size_t len) const override {
    std::shared_ptr<const IpcMapping> m = r_.Lock();
    if (m == nullptr)
      return FailedPrecondition("CUDA region " + name_ + " is closed: its client was released");
    if (offset > m->size || len > m->size - offset)
      return FailedPrecondition("CUDA region " + name_ + " is too small");
    return DeviceSpan{static_cast<char*>(m->base) + offset, m};
  }

 private:
  std::string name_;
  IpcHandleCache::Registration r_;
};

class TestLane final : public CopyLane {
 public:
  explicit TestLane(bool sticky) : sticky_(sticky) {}
  bool synchronous() const override { return true; }
  Status CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) override {
    if (region.device() < 0) return region.ReadAt(offset, dst, len);
    if (sticky_) {
      return CudaStatus(cudaErrorIllegalAddress,
                        "cudaMemcpyAsync device to host (injected by CKPTD_TEST_DEVICE)");
    }
    auto span = region.DeviceAt(offset, len);
    if (!span.ok()) return span.status();
    std::memcpy(dst, span->ptr, len);
    return Status::Ok();
  }
  Status CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src, std::size_t len) override {
    if (region.device() < 0) return region.WriteAt(offset, src, len);
    auto span = region.DeviceAt(offset, len);
    if (!span.ok()) return span.status();
    std::memcpy(span->ptr, src, len);
    return Status::Ok();
  }
  Result<std::uint64_t> EndChunk() override { return ++tickets_; }
  Status WaitChunk(std::uint64_t, const std::function<bool()>&) override { return Status::Ok(); }
  bool Idle() override { return true; }
  Status After(CopyLane&) override { return Status::Ok(); }

 private:
  const bool sticky_;
  std::uint64_t tickets_ = 0;
};

class TestVersionSync final : public VersionSync {
 public:
  explicit TestVersionSync(std::uint32_t slot) : slot_(slot) {}
  Status Gate(CopyLane&) override { return Status::Ok(); }
  Status Signal(const std::vector<CopyLane*>&) override { return Status::Ok(); }
  void Release() override {}
  std::uint32_t daemon_slot() const override { return slot_; }

 private:
  std::uint32_t slot_;
};

class TestSessionEvents final : public SessionEvents {
 public:
  int device() const override { return 0; }
  std::vector<std::string> daemon_handles() const override {
    return std::vector<std::string>(kDaemonEventSlots, std::string(IpcHandle::kBytes, 'e'));
  }
  Result<std::shared_ptr<VersionSync>> Begin(std::uint64_t, std::uint32_t) override {
    return std::shared_ptr<VersionSync>(std::make_shared<TestVersionSync>(next_++ % kDaemonEventSlots));
  }

 private:
  std::atomic<std::uint32_t> next_{0};
};

class TestDeviceBackend final : public DeviceBackend {
 public:
  explicit TestDeviceBackend(const Spec& spec)
      : log_(std::make_shared<LogFile>(spec.log)),
        sticky_copy_(spec.sticky_copy),
        releaser_(std::make_shared<DeviceReleaser>(
            [watch = watch_](int device) { return watch->Abandoned(device); })),
        cache_(std::make_shared<IpcHandleCache>(std::make_shared<ReleasingOpener>(
            std::make_shared<ShmOpener>(log_, spec.block_close), releaser_))) {}
  ~TestDeviceBackend() override {
    cache_.reset();
    releaser_->Stop(std::chrono::steady_clock::now() + DeviceReleaser::kStopGrace);
  }

  std::string Describe() const override {
    return "test device (CKPTD_TEST_DEVICE; never set it in production)";
  }
  bool Owns(std::string_view region_name) const override { return IsCudaRegionName(region_name); }
  Result<std::shared_ptr<ImportedRegion>> Import(const std::string& name, pid_t pid,
                                                 std::uint64_t min_size) override {
    auto ref = ParseCudaRegionName(name);
    if (!ref.ok()) return ref.status();
    auto r = cache_->Register(pid, ref.value().handle, 0);
    if (!r.ok()) return r.status();
    if (r.value().mapping().size < min_size)
      return InvalidArgument("fake device allocation " + name + " is too small");
    return std::shared_ptr<ImportedRegion>(std::make_shared<TestRegion>(name, std::move(r).value()));
  }
  void ReleaseClient(pid_t pid) override { cache_->ReleaseClient(pid); }
  Status AwaitReleases(std::chrono::steady_clock::time_point deadline) override {
    return releaser_->AwaitPosted(deadline);
  }
  Result<std::unique_ptr<SessionEvents>> OpenSession(pid_t, const std::string&,
                                                     const std::vector<std::string>& trainer_events,
                                                     const TrainerReleaseWords*) override {
    if (trainer_events.empty()) return InvalidArgument("the trainer sent no event handles");
    return std::unique_ptr<SessionEvents>(std::make_unique<TestSessionEvents>());
  }
  Result<std::vector<std::unique_ptr<CopyLane>>> MakeLanes(int device, std::uint32_t count) override {
    if (device != 0) return NotFound("no test device " + std::to_string(device));
    std::vector<std::unique_ptr<CopyLane>> lanes;
    for (std::uint32_t i = 0; i < count; ++i) lanes.push_back(std::make_unique<TestLane>(sticky_copy_));
    return lanes;
  }
  Status Pin(void*, std::size_t, int) override { return Status::Ok(); }
  void Unpin(void*) override {}

 private:
  std::shared_ptr<LogFile> log_;
  const bool sticky_copy_;
  std::shared_ptr<LaneWatch> watch_ = std::make_shared<LaneWatch>();
  std::shared_ptr<DeviceReleaser> releaser_;
  std::shared_ptr<IpcHandleCache> cache_;
};

}  // namespace

Result<std::shared_ptr<DeviceBackend>> MakeTestDeviceBackend() {
  const char* env = std::getenv("CKPTD_TEST_DEVICE");
  if (env == nullptr) return std::shared_ptr<DeviceBackend>();
  auto spec = ParseSpec(env);
  if (!spec.ok()) return spec.status();
  spdlog::warn(
      "CKPTD_TEST_DEVICE={}: a fake device stands for CUDA (a test seam; never set it in production)", env);
  return std::shared_ptr<DeviceBackend>(std::make_shared<TestDeviceBackend>(spec.value()));
}

}  // namespace ckpt::cuda
