// SignalCleanup: what a C++ bench leaves behind when SIGTERM, SIGINT or SIGHUP ends it
// (kill, timeout, Ctrl-C, a closed terminal): nothing. A normal exit cleans up as the bench's
// own code does; this covers the signals, whose default action ends the process at once.
//
// The bench names up front (Add) each path it creates: a directory goes whole. On one of the
// three signals a thread that waits for them (sigwait, so it is not a handler) forks a
// remover and raises the signal again with its default action, so that the bench ends at
// once and its exit status still says what ended it. The remover waits until every thread
// of the bench is gone (none can create a file any more), then removes those paths and the
// shared memory libckpt created in the bench, whose names carry its pid
// (/dev/shm/ckpt-UID-PID-*, /dev/shm/ckpt-release-PID-*: no other process's names match).
//
// Install() it first in main, before any thread starts: it blocks the three signals in the
// calling thread, and threads started later inherit that mask. A child that is forked and
// then execs another program calls UnblockInChild() first (the mask survives exec).
// Thread-safe; one per process, never destroyed (a signal may come during exit).
#pragma once

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bench {

class SignalCleanup {
 public:
  static SignalCleanup& Install() {
    static SignalCleanup* const cleanup = new SignalCleanup();
    return *cleanup;
  }
  SignalCleanup(const SignalCleanup&) = delete;
  SignalCleanup& operator=(const SignalCleanup&) = delete;

  // `path` is removed (with all it holds) if a signal ends the process.
  void Add(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.push_back(path);
  }

  // In a forked child, before exec: the signals reach the new program as usual.
  static void UnblockInChild() {
    sigset_t set = Signals();
    ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  }

 private:
  SignalCleanup() {
    sigset_t set = Signals();
    ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([this] { Wait(); }).detach();
  }

  static sigset_t Signals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    return set;
  }

  void Wait() {
    sigset_t set = Signals();
    int sig = 0;
    while (::sigwait(&set, &sig) != 0) {
    }
    std::vector<std::string> paths;
    {
      std::lock_guard<std::mutex> lock(mu_);
      paths = paths_;
    }
    const pid_t bench = ::getpid();
    if (::fork() == 0) {
      AwaitExit(bench);
      std::error_code ec;
      for (const auto& p : paths) std::filesystem::remove_all(p, ec);
      RemoveShmOf(bench);
      std::_Exit(0);
    }
    ::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);  // the default action ends the process here
    std::_Exit(128 + sig);
  }

  // Returns once process `pid` (every thread of it) has exited.
  static void AwaitExit(pid_t pid) {
    const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
      }
      ::close(fd);
      return;
    }
    while (::getppid() == pid) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  static void RemoveShmOf(pid_t owner) {
    const std::string pid = std::to_string(owner);
    const std::string region = "ckpt-" + std::to_string(::getuid()) + "-" + pid + "-";
    const std::string release = "ckpt-release-" + pid + "-";
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(region, 0) == 0 || name.rfind(release, 0) == 0) ::shm_unlink(("/" + name).c_str());
    }
  }

  std::mutex mu_;
  std::vector<std::string> paths_;
};

}  // namespace bench
