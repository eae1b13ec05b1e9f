// SignalCleanup: what a C++ bench leaves behind when SIGTERM, SIGINT or SIGHUP ends it
// (kill, timeout, Ctrl-C, a closed terminal): nothing. A normal exit cleans up as the bench's
// own code does; this covers the signals, whose default action ends the process at once.
//
// The bench names up front (Add) each path it creates: a directory goes whole. On one of the
// three signals a thread that waits for them (sigwait, so it is not a handler: it may
// allocate and walk directories while the other threads run on) removes those paths and the
// shared memory libckpt created in this process, whose names carry its pid
// (/dev/shm/ckpt-UID-PID-*, /dev/shm/ckpt-release-PID-*: no other process's names match), then
// raises the signal again with its default action, so the exit status still says what ended
// the bench.
//
// Install() it first in main, before any thread starts: it blocks the three signals in the
// calling thread, and threads started later inherit that mask. A child that is forked and
// then execs another program calls UnblockInChild() first (the mask survives exec).
// Thread-safe; one per process, never destroyed (a signal may come during exit).
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

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
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::error_code ec;
      for (const auto& p : paths_) std::filesystem::remove_all(p, ec);
    }
    RemoveOwnShm();
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);  // the default action ends the process here
    std::_Exit(128 + sig);
  }

  static void RemoveOwnShm() {
    const std::string pid = std::to_string(::getpid());
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
