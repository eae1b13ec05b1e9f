#include "cuda/release_word_writer.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <vector>

#include "common/mutex.h"
#include "cuda/cuda_error.h"
#include "cuda/driver_api.h"

namespace ckpt::cuda {
namespace {

constexpr std::uint32_t kMaxWords = 1024;

// Page-locked words of one trainer. A write may still be queued behind a stream that never
// runs again (copies behind a dead trainer's event): then the words stay registered and
// mapped until the process exits, never unregistered under a pending write.
class CudaReleaseWordWriter final : public ReleaseWordWriter {
 public:
  CudaReleaseWordWriter(const DriverApi& driver, int device, TrainerReleaseWords words, CUdeviceptr address,
                        std::shared_ptr<DeviceReleaser> releaser)
      : driver_(driver),
        device_(device),
        words_(std::move(words)),
        address_(address),
        releaser_(std::move(releaser)) {}

  ~CudaReleaseWordWriter() override {
    if (::cudaSetDevice(device_) != cudaSuccess) {
      Retire();
      return;
    }
    MutexLock lock(mu_);
    bool pending = false;
    for (cudaEvent_t e : written_)
      pending = pending || (e != nullptr && ::cudaEventQuery(e) == cudaErrorNotReady);
    if (pending) {
      spdlog::warn("release words {:p}: a write is still queued; they stay mapped until ckptd exits",
                   words_.host);
      Retire();
      return;
    }
    // The unregister can synchronise behind a stuck stream: it runs on the releaser's thread
    // (put off while a lane on this device waits on a dead trainer), keeping the mapping.
    auto release = [device = device_, host = words_.host, keep = words_.keep, events = written_] {
      (void)::cudaSetDevice(device);
      for (cudaEvent_t e : events) {
        if (e != nullptr) (void)::cudaEventDestroy(e);
      }
      (void)::cudaHostUnregister(host);
    };
    if (releaser_) {
      releaser_->Post(device_, std::move(release));
    } else {
      release();
    }
  }

  std::uint32_t count() const override {
    return static_cast<std::uint32_t>(words_.bytes / sizeof(std::uint32_t));
  }
  std::uint32_t base() const override { return words_.base; }

  Status Write(void* stream, std::uint32_t slot, std::uint32_t value) override {
    if (slot >= count()) {
      return InvalidArgument("release word " + std::to_string(slot) + " is outside the trainer's " +
                             std::to_string(count()) + " words");
    }
    if (Status s = CudaStatus(::cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    const CUdeviceptr word = address_ + slot * sizeof(std::uint32_t);
    if (Status s = driver_.Check(driver_.cuStreamWriteValue32(static_cast<CUstream>(stream), word, value,
                                                              CU_STREAM_WRITE_VALUE_DEFAULT),
                                 "cuStreamWriteValue32 (release word)");
        !s.ok()) {
      return s;
    }
    MutexLock lock(mu_);
    if (written_.size() < count()) written_.resize(count(), nullptr);
    cudaEvent_t& e = written_[slot];
    if (e == nullptr) {
      if (Status s = CudaStatus(::cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
          !s.ok()) {
        e = nullptr;
        return s;
      }
    }
    return CudaStatus(::cudaEventRecord(e, static_cast<cudaStream_t>(stream)),
                      "cudaEventRecord (release word)");
  }

 private:
  // Keeps the mapping (and its registration) for the rest of the process.
  void Retire() {
    static Mutex retired_mu;
    static auto* retired = new std::vector<std::shared_ptr<const void>>();
    MutexLock lock(retired_mu);
    retired->push_back(words_.keep);
  }

  const DriverApi& driver_;
  const int device_;
  const TrainerReleaseWords words_;
  const CUdeviceptr address_;
  const std::shared_ptr<DeviceReleaser> releaser_;
  Mutex mu_;
  std::vector<cudaEvent_t> written_ GUARDED_BY(mu_);  // per word: recorded after its last write
};

}  // namespace

Result<std::unique_ptr<ReleaseWordWriter>> MakeCudaReleaseWordWriter(int device, const TrainerReleaseWords& words,
                                                                     std::shared_ptr<DeviceReleaser> releaser) {
  const auto& driver = Driver();
  if (!driver.ok()) return driver.status();
  if (driver->cuStreamWriteValue32 == nullptr) {
    return FailedPrecondition("the CUDA driver provides no cuStreamWriteValue32");
  }
  if (words.host == nullptr || words.bytes < sizeof(std::uint32_t) ||
      words.bytes / sizeof(std::uint32_t) > kMaxWords) {
    return InvalidArgument("the trainer's release words are " + std::to_string(words.bytes) + " bytes");
  }
  if (Status s = CudaStatus(::cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  if (Status s = CudaStatus(
          ::cudaHostRegister(words.host, words.bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
          "cudaHostRegister (release words)");
      !s.ok()) {
    return s;
  }
  void* address = nullptr;
  if (Status s = CudaStatus(::cudaHostGetDevicePointer(&address, words.host, 0), "cudaHostGetDevicePointer");
      !s.ok()) {
    (void)::cudaHostUnregister(words.host);
    return s;
  }
  return std::unique_ptr<ReleaseWordWriter>(std::make_unique<CudaReleaseWordWriter>(
      driver.value(), device, words, reinterpret_cast<CUdeviceptr>(address), std::move(releaser)));
}

}  // namespace ckpt::cuda
