// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with Clang's
// thread-safety annotations (common/thread_annotations.h), so that `GUARDED_BY(mu_)` and
// `REQUIRES(mu_)` are checked by `clang++ -Wthread-safety` (the CI's clang build).
//
// Waiting: write the loop out, `while (!ready_) cv_.Wait(mu_);`, rather than passing a
// predicate lambda: the analysis cannot see that a lambda runs with the lock held, and the
// loop reads as what it is. CondVar::WaitUntil returns false once the deadline passed.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace ckpt {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // True if the lock was free and is now held.
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // For the analysis only: documents (and tells the compiler) that the caller holds it.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction; Unlock() and Lock() let go of it and take it
// again in between (for a blocking call made without the lock).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_.Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() {
    mu_.Unlock();
    held_ = false;
  }
  void Lock() ACQUIRE() {
    mu_.Lock();
    held_ = true;
  }

 private:
  Mutex& mu_;
  bool held_ = true;
};

class CondVar {
 public:
  // Atomically releases `mu`, waits for a notification (or a spurious wake-up), takes `mu`
  // again.
  void Wait(Mutex& mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // As Wait, but returns false if `deadline` passed (the caller re-checks its condition
  // either way).
  template <class Clock, class Duration>
  bool WaitUntil(Mutex& mu, std::chrono::time_point<Clock, Duration> deadline) REQUIRES(mu) {
    if (deadline == std::chrono::time_point<Clock, Duration>::max()) {  // never overflows
      Wait(mu);
      return true;
    }
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool notified = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return notified;
  }
  template <class Rep, class Period>
  bool WaitFor(Mutex& mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace ckpt
