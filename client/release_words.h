// Release words: the trainer-owned memory a stream-ordered wait_snapshot_on_stream waits on,
// so that the trainer, not only the daemon, can end the wait (private to libckpt).
//
// One page of POSIX shared memory holds 64 32-bit words, one per slot of the daemon's
// event ring. The trainer maps it into the device (cudaHostRegister, mapped and portable)
// and makes its stream wait with cuStreamWaitValue32(word[slot] >= value, cyclic); the
// daemon maps the same object and its copy stream writes the value after the version's
// copies (cuStreamWriteValue32). When the daemon process exits (a DaemonWatch on its pidfd
// says so), the client stores the floor into every word from the host, which ends every
// wait the stream still has: the trainer goes on, and its next call reports the versions
// the daemon lost (ckpt/client.h).
//
// Values (the sequence bookkeeping): the floor is the highest value any daemon may have
// been told to write. A session starts at base = floor (sent in CudaSession.release_base);
// the daemon's n-th version of the session gets base + n. Every Snapshot RPC the client
// sends raises the floor by one before it goes out, and the daemon takes at most one value
// per Snapshot it receives, so every value written or waited for is <= floor: storing the
// floor releases every wait and never moves a word back, and a new session's values are
// all above what any word holds. Values wrap modulo 2^32; cuStreamWaitValue32's cyclic
// comparison ((int32_t)(*addr - value) >= 0) holds across the wrap as long as the words
// stay within 2^31 of each other, which 64 slots keep by far.
//
// Thread-safety: all methods may be called from any thread. The floor and the words are
// atomics; ReleaseAll may race with a stream's wait (that is its point) and with a
// concurrent NoteSnapshotSent (the floor it stores is then still >= every value handed out
// before it began).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

inline constexpr std::uint32_t kReleaseWordCount = 64;  // = the daemon's event ring slots
inline constexpr std::size_t kReleaseWordsBytes = 4096;

class ReleaseWords {
 public:
  // A new shared-memory object (0600, a unique name) of one page, zero-filled.
  static Result<std::shared_ptr<ReleaseWords>> Create();
  ~ReleaseWords();
  ReleaseWords(const ReleaseWords&) = delete;
  ReleaseWords& operator=(const ReleaseWords&) = delete;

  // The shm_open name (CudaSession.release_words).
  const std::string& name() const { return name_; }
  // The page, for cudaHostRegister, and the word of `slot` (< kReleaseWordCount).
  void* data() const { return words_; }
  std::atomic<std::uint32_t>& word(std::uint32_t slot) const { return words_[slot % kReleaseWordCount]; }

  // The base of a new session: the floor now.
  std::uint32_t SessionBase() const { return floor_.load(std::memory_order_acquire); }
  // A Snapshot RPC is about to be sent: its version may get the value floor + 1.
  void NoteSnapshotSent() { floor_.fetch_add(1, std::memory_order_acq_rel); }
  std::uint32_t floor() const { return floor_.load(std::memory_order_acquire); }

  // Removes the name (no daemon opens the words again); the mapping stays valid.
  void Unlink();

  // Stores the floor into every word (from the host), ending every wait on them.
  void ReleaseAll();
  // How many times ReleaseAll ran.
  std::uint64_t releases() const { return releases_.load(std::memory_order_acquire); }

 private:
  ReleaseWords(std::string name, int fd, void* mapping);

  std::string name_;
  UniqueFd fd_;
  std::atomic<std::uint32_t>* words_;
  std::atomic<std::uint32_t> floor_{0};
  std::atomic<std::uint64_t> releases_{0};
};

// Watches one daemon process at a time through its pidfd and calls `on_exit` once when it
// exits (on the watcher's own thread, or in Watch() when the process it replaces had
// exited unseen). Watch() replaces the process watched; the destructor stops the thread.
// Event driven: poll() on the pidfd and an eventfd, no timer.
class DaemonWatch {
 public:
  explicit DaemonWatch(std::function<void()> on_exit);
  ~DaemonWatch();
  DaemonWatch(const DaemonWatch&) = delete;
  DaemonWatch& operator=(const DaemonWatch&) = delete;

  // Opens a pidfd for `pid`, valid only if this process shares the daemon's PID namespace
  // (`daemon_namespace` as RegisterReply.daemon_pid_namespace names it). Fails, watching
  // the previous process still, when the namespaces differ or pidfd_open is refused (the caller then
  // uses the daemon's events instead of the release words).
  Status Watch(pid_t pid, const std::string& daemon_namespace);
  // How many exits were seen and handled (counted once on_exit has returned).
  std::uint64_t exits() const { return exits_.load(std::memory_order_acquire); }

 private:
  void Run();
  void Wake();

  std::function<void()> on_exit_;
  UniqueFd wake_;  // eventfd
  Mutex mu_;
  UniqueFd pidfd_ GUARDED_BY(mu_);
  std::uint64_t generation_ GUARDED_BY(mu_) = 0;  // bumped when pidfd_ changes
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<std::uint64_t> exits_{0};
  std::thread thread_;
};

}  // namespace ckpt
