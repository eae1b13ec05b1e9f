#include "cuda/device_releaser.h"

#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "common/mutex.h"

namespace ckpt::cuda {

struct DeviceReleaser::State {
  struct Task {
    std::uint64_t seq = 0;
    int device = -1;
    std::function<void()> release;
  };

  State(std::function<bool(int)> a, std::chrono::milliseconds r) : abandoned(std::move(a)), recheck(r) {}

  // True when every task up to `target` has run or is put off.
  bool Settled(std::uint64_t target) const REQUIRES(mu) {
    return (queue.empty() || queue.front().seq > target) && (running == 0 || running > target);
  }

  void Loop();

  const std::function<bool(int)> abandoned;
  const std::chrono::milliseconds recheck;
  mutable Mutex mu;
  CondVar changed;
  // In increasing seq: put-off tasks go back to the front when retried.
  std::deque<Task> queue GUARDED_BY(mu);
  std::deque<Task> put_off GUARDED_BY(mu);
  std::uint64_t next_seq GUARDED_BY(mu) = 1;
  std::uint64_t running GUARDED_BY(mu) = 0;  // seq of the task being run, 0 if none
  std::uint64_t run GUARDED_BY(mu) = 0;
  bool stopping GUARDED_BY(mu) = false;
  // Past it, a stopping thread runs nothing more (it was left behind).
  std::chrono::steady_clock::time_point stop_deadline GUARDED_BY(mu) =
      std::chrono::steady_clock::time_point::max();
  bool exited GUARDED_BY(mu) = false;
};

void DeviceReleaser::State::Loop() {
  MutexLock lock(mu);
  for (;;) {
    while (!stopping && queue.empty() && put_off.empty()) changed.Wait(mu);
    if (stopping && (queue.empty() || std::chrono::steady_clock::now() >= stop_deadline)) break;
    if (queue.empty()) {
      // Only put-off releases: look again after a while (or when something new comes).
      changed.WaitFor(mu, recheck);
      if (stopping || !queue.empty()) continue;
      while (!put_off.empty()) {
        queue.push_front(std::move(put_off.back()));
        put_off.pop_back();
      }
    }
    Task task = std::move(queue.front());
    queue.pop_front();
    running = task.seq;
    lock.Unlock();
    const bool blocked = abandoned(task.device);
    if (!blocked) task.release();
    lock.Lock();
    running = 0;
    if (blocked) {
      put_off.push_back(std::move(task));
    } else {
      ++run;
    }
    changed.SignalAll();
  }
  exited = true;
  changed.SignalAll();
}

DeviceReleaser::DeviceReleaser(std::function<bool(int device)> abandoned, std::chrono::milliseconds recheck)
    : state_(std::make_shared<State>(std::move(abandoned), recheck)) {
  // The thread holds the state, so a thread left behind by Stop never outlives it.
  std::thread([state = state_] { state->Loop(); }).detach();
}

DeviceReleaser::~DeviceReleaser() { Stop(std::chrono::steady_clock::now() + kStopGrace); }

void DeviceReleaser::Post(int device, std::function<void()> release) {
  {
    MutexLock lock(state_->mu);
    if (state_->stopping) return;
    state_->queue.push_back(State::Task{state_->next_seq++, device, std::move(release)});
  }
  state_->changed.SignalAll();
}

Status DeviceReleaser::AwaitPosted(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(state_->mu);
  const std::uint64_t target = state_->next_seq - 1;
  while (!state_->Settled(target) && !state_->exited) {
    if (!state_->changed.WaitUntil(state_->mu, deadline)) break;
  }
  if (!state_->Settled(target) && !state_->exited) {
    return DeadlineExceeded(
        "a close or unpin of device memory has not returned in time (it may be synchronising behind a "
        "stream that waits on an event of a trainer that exited); it goes on in the background");
  }
  std::size_t put_off = 0;
  for (const auto& t : state_->put_off) put_off += t.seq <= target;
  if (put_off > 0) {
    return FailedPrecondition(std::to_string(put_off) +
                              " close(s) or unpin(s) of device memory put off: a copy on the same GPU waits "
                              "on an event of a trainer that exited; they run once it drains, or the "
                              "process exit reclaims the memory");
  }
  return Status::Ok();
}

void DeviceReleaser::Stop(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(state_->mu);
  if (!state_->stopping) {
    state_->stopping = true;
    state_->stop_deadline = deadline;
    state_->changed.SignalAll();
  }
  while (!state_->exited) {
    if (!state_->changed.WaitUntil(state_->mu, deadline)) break;
  }
  // Either it exited, or it is stuck in a release: the detached thread ends with it, or
  // with the process.
}

DeviceReleaser::Counts DeviceReleaser::counts() const {
  MutexLock lock(state_->mu);
  Counts c;
  c.posted = state_->next_seq - 1;
  c.run = state_->run;
  c.put_off = state_->put_off.size();
  return c;
}

}  // namespace ckpt::cuda
