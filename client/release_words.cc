#include "client/release_words.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "common/pid_namespace.h"

namespace ckpt {

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
              std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(kReleaseWordCount * sizeof(std::uint32_t) <= kReleaseWordsBytes);

// ---- ReleaseWords -----------------------------------------------------------------------

Result<std::shared_ptr<ReleaseWords>> ReleaseWords::Create() {
  std::random_device random;
  for (int attempt = 0;; ++attempt) {
    const std::string name = "/ckpt-release-" + std::to_string(::getpid()) + "-" + std::to_string(random());
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == EEXIST && attempt < 8) continue;
    if (fd < 0) return IoError("create the release words " + name, errno);
    UniqueFd owned(fd);
    if (::ftruncate(fd, kReleaseWordsBytes) != 0) {
      const int err = errno;
      ::shm_unlink(name.c_str());
      return IoError("size the release words " + name, err);
    }
    void* mapping = ::mmap(nullptr, kReleaseWordsBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::shm_unlink(name.c_str());
      return IoError("map the release words " + name, err);
    }
    return std::shared_ptr<ReleaseWords>(new ReleaseWords(name, owned.release(), mapping));
  }
}

ReleaseWords::ReleaseWords(std::string name, int fd, void* mapping)
    : name_(std::move(name)), fd_(fd), words_(static_cast<std::atomic<std::uint32_t>*>(mapping)) {}

ReleaseWords::~ReleaseWords() {
  ::munmap(words_, kReleaseWordsBytes);
  ::shm_unlink(name_.c_str());
}

void ReleaseWords::Unlink() { ::shm_unlink(name_.c_str()); }

void ReleaseWords::ReleaseAll() {
  const std::uint32_t value = floor();
  // Sequentially consistent stores: the device reads the words over PCIe, coherently with
  // the CPU's caches; nothing else needs ordering.
  for (std::uint32_t i = 0; i < kReleaseWordCount; ++i) words_[i].store(value);
  releases_.fetch_add(1, std::memory_order_acq_rel);
}

// ---- DaemonWatch ------------------------------------------------------------------------

DaemonWatch::DaemonWatch(std::function<void()> on_exit)
    : on_exit_(std::move(on_exit)), wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { Run(); });
}

DaemonWatch::~DaemonWatch() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
}

Status DaemonWatch::Watch(pid_t pid, const std::string& daemon_namespace) {
  // On failure the previous daemon stays watched: its exit still releases what waits on it.
  if (!wake_.valid()) return Internal("eventfd for the daemon watch could not be made");
  if (pid <= 0) return FailedPrecondition("the daemon did not report its pid");
  auto mine = PidNamespaceOf(0);
  if (!mine.ok()) return mine.status();
  if (daemon_namespace != mine.value()) {
    return FailedPrecondition("ckptd runs in PID namespace " +
                              (daemon_namespace.empty() ? std::string("(not reported)") : daemon_namespace) +
                              ", this trainer in " + mine.value() + ": its pid " + std::to_string(pid) +
                              " means another process here");
  }
  UniqueFd fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!fd.valid()) return IoError("pidfd_open of ckptd (pid " + std::to_string(pid) + ")", errno);
  UniqueFd old;
  {
    MutexLock lock(mu_);
    old = std::move(pidfd_);
    pidfd_ = std::move(fd);
    ++generation_;
  }
  Wake();
  // The previous daemon's exit, if the watcher had not taken it yet (it now ignores it).
  if (old.valid()) {
    pollfd p{old.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) == 1) {
      on_exit_();
      exits_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  return Status::Ok();
}

void DaemonWatch::Wake() {
  if (!wake_.valid()) return;
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void DaemonWatch::Run() {
  if (!wake_.valid()) return;
  for (;;) {
    int pidfd = -1;
    std::uint64_t generation = 0;
    {
      MutexLock lock(mu_);
      if (stop_) return;
      pidfd = pidfd_.get();
      generation = generation_;
    }
    // A pidfd replaced (and closed) while this poll runs is not looked at again: Watch wakes
    // the poll, and the generation tells a stale exit from the current one.
    pollfd fds[2] = {{wake_.get(), POLLIN, 0}, {pidfd, POLLIN, 0}};
    const int r = ::poll(fds, pidfd >= 0 ? 2 : 1, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return;
    if ((fds[0].revents & POLLIN) != 0) {
      std::uint64_t count = 0;
      (void)!::read(wake_.get(), &count, sizeof count);
      continue;
    }
    if (pidfd < 0 || fds[1].revents == 0) continue;
    {
      MutexLock lock(mu_);
      if (generation != generation_) continue;
      pidfd_.reset();
      ++generation_;
    }
    on_exit_();
    exits_.fetch_add(1, std::memory_order_acq_rel);
  }
}

}  // namespace ckpt
