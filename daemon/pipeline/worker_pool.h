// WorkerPool: a FIFO of work items served by a fixed set of threads: the one way the engines
// run workers (the snapshot engine's copy threads, the flush engine's writers). Items are
// taken in order of arrival, each by one thread; Stop() lets every queued item be served,
// then joins the threads, so nothing pushed before Stop() is dropped. The threads start in
// the constructor: build the pool last, once everything its handler uses exists.
// Thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"

namespace ckpt {

template <typename Item>
class WorkerPool {
 public:
  using Handler = std::function<void(Item&)>;

  WorkerPool(unsigned threads, Handler handler) : handler_(std::move(handler)) {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { Serve(); });
  }
  ~WorkerPool() { Stop(); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Push(Item item) EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      items_.push_back(std::move(item));
    }
    ready_.Signal();
  }

  // Serves what is queued, then stops the threads. Idempotent.
  void Stop() EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    ready_.SignalAll();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void Serve() EXCLUDES(mu_) {
    for (;;) {
      std::optional<Item> item;
      {
        MutexLock lock(mu_);
        while (!stopping_ && items_.empty()) ready_.Wait(mu_);
        if (items_.empty()) return;  // stopping, and nothing left
        item.emplace(std::move(items_.front()));
        items_.pop_front();
      }
      handler_(*item);
    }
  }

  const Handler handler_;
  Mutex mu_;
  CondVar ready_;
  std::deque<Item> items_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ckpt
