// IpcHandleCache: the daemon's table of CUDA IPC allocations it has opened, so that each
// distinct (client process, cudaIpcMemHandle_t) is opened exactly once however many
// registrations refer to it.
//
// In: Register(pid, handle, device) for every region a client registers (the pid comes
// from the session's peer credentials, never from the request); ReleaseClient(pid) when a
// client exits. Out: a Registration, which holds one reference and gives the mapping
// (device pointer of the allocation base and its size).
//
// Lifetime: an entry is opened by the first Register and dropped from the cache when its
// last Registration is destroyed, or at once by ReleaseClient(pid). Only the cache entry
// keeps the mapping open; a copy pins it for its duration with Registration::Lock(), so
// the handle is closed, exactly once, when the entry is dropped and no copy is running.
// After ReleaseClient(pid), that pid's outstanding Registrations count for nothing and
// their Lock() returns null. Opening and closing go through an IpcOpener, so tests use a
// fake that counts calls; the daemon's opener posts each close to its DeviceReleaser
// (cuda/device_releaser.h), so a close never runs on the thread that let go.
//
// Thread-safety: all members are thread-safe. Opens happen under the cache's lock (they
// are rare: once per allocation per client); closes never do. A Registration may outlive
// the cache.
#pragma once

#include <sys/types.h>

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ckpt::cuda {

// The 64 opaque bytes of a cudaIpcMemHandle_t (or cudaIpcEventHandle_t).
struct IpcHandle {
  static constexpr std::size_t kBytes = 64;
  std::array<std::uint8_t, kBytes> bytes{};

  auto operator<=>(const IpcHandle&) const = default;
  // 128 lowercase hex digits.
  std::string Hex() const;
  static Result<IpcHandle> FromHex(std::string_view hex);
};

// An opened allocation in the daemon's address space.
struct IpcMapping {
  void* base = nullptr;    // device pointer of the allocation's first byte
  std::uint64_t size = 0;  // bytes of the allocation
  int device = -1;         // ordinal of the device it lives on, in the daemon's numbering
};

class IpcOpener {
 public:
  virtual ~IpcOpener() = default;
  // Opens `handle` on device `device` (cudaIpcOpenMemHandle), returning base and size.
  virtual Result<IpcMapping> Open(const IpcHandle& handle, int device) = 0;
  // Closes a mapping Open returned (cudaIpcCloseMemHandle). Called exactly once per Open.
  virtual Status Close(const IpcMapping& mapping) = 0;
};

class IpcHandleCache {
  struct State;

 public:
  struct Key {
    pid_t pid = 0;
    IpcHandle handle;
    auto operator<=>(const Key&) const = default;
  };

  // One registration's reference to a cached mapping. Move-only; releases on destruction.
  class Registration {
   public:
    Registration() = default;
    Registration(Registration&& other) noexcept { *this = std::move(other); }
    Registration& operator=(Registration&& other) noexcept;
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    ~Registration() { Reset(); }

    // True while this object holds a reference (until Reset or a move).
    bool valid() const { return serial_ != 0; }
    // Where and how large the allocation is (a copy of the values; it stays readable even
    // after the mapping was closed).
    const IpcMapping& mapping() const { return info_; }
    // Keeps the mapping open for as long as the caller holds the result (e.g. during a
    // copy); null once the entry was dropped (ReleaseClient, cache destroyed).
    std::shared_ptr<const IpcMapping> Lock() const { return mapping_.lock(); }
    // Drops this reference now.
    void Reset();

   private:
    friend class IpcHandleCache;
    std::weak_ptr<State> state_;
    Key key_;
    std::uint64_t serial_ = 0;
    IpcMapping info_;
    std::weak_ptr<const IpcMapping> mapping_;
  };

  explicit IpcHandleCache(std::shared_ptr<IpcOpener> opener);
  ~IpcHandleCache();
  IpcHandleCache(const IpcHandleCache&) = delete;
  IpcHandleCache& operator=(const IpcHandleCache&) = delete;

  // Opens (pid, handle) on `device` unless it is cached, and takes a reference. Fails if
  // the open fails, or if the same handle is cached for that pid on another device.
  Result<Registration> Register(pid_t pid, const IpcHandle& handle, int device);

  // Forgets every mapping of `pid` (the client exited): each is closed at once, or when the
  // copies that hold it finish. Returns how many entries were dropped.
  std::size_t ReleaseClient(pid_t pid);

  // Entries cached now, and live registrations of one entry (0 if not cached).
  std::size_t size() const;
  std::uint32_t references(pid_t pid, const IpcHandle& handle) const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace ckpt::cuda
