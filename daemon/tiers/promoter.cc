#include "daemon/tiers/promoter.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "daemon/metrics/daemon_metrics.h"
#include "format/paths.h"

namespace ckpt {

Promoter::Promoter(LocalTier& local, MemoryTier& memory, ShardCopier& copier, const Catalog& catalog,
                   bool persistent_direct_io, Hooks hooks)
    : local_(local),
      memory_(memory),
      copier_(copier),
      catalog_(catalog),
      persistent_direct_io_(persistent_direct_io),
      hooks_(std::move(hooks)) {}

void Promoter::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Promoter::Stop() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
}

void Promoter::Enqueue(Task task) {
  local_.Pin(task.meta.job, task.meta.version);  // until promoted
  {
    MutexLock lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.Signal();
}

std::uint32_t Promoter::pending() const {
  MutexLock lock(mu_);
  return static_cast<std::uint32_t>(queue_.size() + (running_ ? 1 : 0));
}

void Promoter::Loop() {
  for (;;) {
    Task task;
    {
      MutexLock lock(mu_);
      running_ = false;
      while (!stop_ && queue_.empty()) cv_.Wait(mu_);
      if (queue_.empty()) return;  // stopping, and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    Promote(task);
    local_.Unpin(task.meta.job, task.meta.version);
  }
}

void Promoter::Promote(const Task& task) {
  const ShardMeta& m = task.meta;
  ShardCopier::Source src;
  src.path = task.local_path;
  src.direct_io = local_.direct_io();
  src.file_bytes = task.file_bytes;
  // From the memory tier's image if it still has one (no read); queued tasks hold none,
  // so the tier's budget is spent on what it keeps.
  src.image = memory_.Find(m.job, m.version, m.rank);
  if (src.image && src.image->meta.session != m.session) src.image = nullptr;
  ShardCopier::Target dst{catalog_.VersionDir(m.job, m.version), ShardFileName(m.rank), persistent_direct_io_,
                          m.version};
  const auto start = std::chrono::steady_clock::now();
  auto copied = copier_.Copy(src, dst);
  if (!copied.ok()) {
    Status st = copied.status().With("promote to the persistent tier");
    if (task.shard) {
      task.shard->Fail(st);
      hooks_.on_failed(task.shard);
    } else {
      hooks_.on_error("job " + m.job + " rank " + std::to_string(m.rank) + " version " +
                      std::to_string(m.version) + ": " + st.message());
    }
    return;
  }
  metrics::Metrics().Promoted(
      task.file_bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (!hooks_.on_persisted(m, task.shard)) {
    if (task.shard) hooks_.on_failed(task.shard);
    return;
  }
  if (task.shard) {
    task.shard->Reach(Level::kPersisted);
  } else {
    spdlog::info("job {} rank {} version {}: promotion resumed and done", m.job, m.rank, m.version);
  }
}

}  // namespace ckpt
