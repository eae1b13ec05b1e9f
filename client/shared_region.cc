#include "client/shared_region.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>

#include "client/errors.h"
#include "common/mutex.h"

namespace ckpt {
namespace {

// The regions this process created that are still alive, whose names are removed when the
// process exits (std::atexit). A region's destructor removes its name, but an interpreter
// frees few objects at exit (torch 2.x keeps tensors, and through them the regions they view,
// to the end), so it may never run, and the name would stay in /dev/shm after the process is
// gone: the daemon removes the names of a trainer that died registered, but one that
// unregistered (every Client does when destroyed) is trusted to remove its own. Removing a
// name loses nothing: mappings and the daemon's descriptors stay valid. Only the process that
// created a region removes its name (a forked child that exits leaves its parent's), and
// only while the name still refers to that object.
class LiveRegionNames {
 public:
  // Never destroyed: regions may be destroyed during static destruction, after exit handlers.
  static LiveRegionNames& Get() {
    static LiveRegionNames* const names = new LiveRegionNames();
    return *names;
  }

  void Add(const ShmRegion* r) {
    MutexLock lock(mu_);
    if (!exit_handler_) exit_handler_ = std::atexit([] { Get().RemoveAll(); }) == 0;
    live_[r] = ::getpid();
  }
  void Remove(const ShmRegion* r) {
    MutexLock lock(mu_);
    live_.erase(r);
  }

 private:
  void RemoveAll() {
    MutexLock lock(mu_);  // a region destroyed meanwhile waits here, so every one listed is alive
    const pid_t self = ::getpid();
    for (const auto& [r, creator] : live_) {
      struct stat st {};
      if (creator == self && ::fstat(r->fd(), &st) == 0) UnlinkShmIfInode(r->name(), st.st_ino);
    }
    live_.clear();
  }

  Mutex mu_;
  bool exit_handler_ GUARDED_BY(mu_) = false;
  std::map<const ShmRegion*, pid_t> live_ GUARDED_BY(mu_);
};

}  // namespace

PosixSharedRegion::PosixSharedRegion(ShmRegion r) : region_(std::move(r)) {
  LiveRegionNames::Get().Add(&region_);
}

PosixSharedRegion::~PosixSharedRegion() { LiveRegionNames::Get().Remove(&region_); }

void PosixSharedRegion::resize(std::size_t bytes) {
  if (Status s = region_.Resize(bytes); !s.ok()) Throw(s);
}

std::shared_ptr<SharedRegion> SharedRegion::create(std::size_t bytes, const std::string& name) {
  auto r = ShmRegion::Create(name, bytes);
  if (!r.ok()) Throw(r.status());
  return std::make_shared<PosixSharedRegion>(std::move(r).value());
}

}  // namespace ckpt
