#include "daemon/pipeline/promoter.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cerrno>

#include <algorithm>
#include <chrono>

#include "daemon/metrics/daemon_metrics.h"
#include "common/safe_file.h"
#include "format/paths.h"

namespace ckpt {

Promoter::Promoter(LocalTier& local, MemoryTier& memory, ShardCopier& copier, const Catalog& catalog,
                   bool persistent_direct_io, Hooks hooks, BaseChooser* bases)
    : local_(local),
      memory_(memory),
      copier_(copier),
      catalog_(catalog),
      persistent_direct_io_(persistent_direct_io),
      hooks_(std::move(hooks)),
      bases_(bases) {}

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

namespace {

// How many started versions a job remembers: enough for the one running and the few whose
// late ranks may still arrive behind it.
constexpr std::size_t kStartedKept = 16;

// The header of a complete memory-tier image.
Result<ShardInfo> ParseImageHeader(const MemoryImage& image) {
  if (image.file_bytes < 8) return DataLoss("the memory image is too short");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(image.data()[i]);
  if (n > image.file_bytes - 8) return DataLoss("the memory image's header runs past its end");
  return ParseShardHeader(std::string_view(image.data() + 8, n), image.file_bytes);
}

std::string ShardName(const ShardMeta& m) {
  return "version " + std::to_string(m.version) + " of job '" + m.job + "' (rank " + std::to_string(m.rank) +
         ")";
}

}  // namespace

std::uint64_t Promoter::SupersededByLocked(const ShardMeta& m, std::uint32_t keep_every) {
  const JobState& j = jobs_[m.job];
  if (j.started.count(m.version) != 0) return 0;
  if (keep_every > 0 && m.version % keep_every == 0) return j.newest_kept > m.version ? j.newest_kept : 0;
  return j.newest > m.version ? j.newest : 0;
}

void Promoter::Enqueue(Task task) {
  local_.Pin(task.meta.job, task.meta.version);  // until promoted or skipped
  const std::string job = task.meta.job;
  std::vector<Skipped> skipped;
  {
    MutexLock lock(mu_);
    // Read per call: a reload (SIGHUP) may change it. Without keep_last every committed
    // version is kept, and no multiple is special.
    const Catalog::Retention retention = catalog_.retention();
    const std::uint32_t keep_every = retention.keep_last > 0 ? retention.keep_every : 0;
    JobState& j = jobs_[job];
    const std::uint64_t v = task.meta.version;
    j.newest = std::max(j.newest, v);
    if (keep_every > 0 && v % keep_every == 0) j.newest_kept = std::max(j.newest_kept, v);
    j.ranks.insert(task.meta.rank);
    const bool all_ranks_here = j.ranks.size() >= task.meta.world_size;
    queue_.push_back(std::move(task));
    for (auto it = queue_.begin(); all_ranks_here && it != queue_.end();) {
      const std::uint64_t by = it->meta.job == job ? SupersededByLocked(it->meta, keep_every) : 0;
      if (by == 0) {
        ++it;
        continue;
      }
      std::string why = ShardName(it->meta) + " was not persisted: superseded by version " +
                        std::to_string(by) +
                        " before it was persisted (the persistent tier absorbs versions more slowly than "
                        "they arrive; the newest goes next)";
      skipped.push_back({std::move(*it), std::move(why), by});
      it = queue_.erase(it);
    }
  }
  cv_.Signal();
  Skip(std::move(skipped));
}

void Promoter::AbandonRunningLocked(const std::string& job, std::uint32_t rank, std::uint64_t below,
                                    std::string why, std::uint64_t by) {
  if (!running_ || running_meta_.job != job || running_meta_.rank != rank) return;
  if (below != 0 && running_meta_.version >= below) return;
  if (abandon_) return;
  spdlog::info("abandoning a running promotion: {}", why);
  abandon_why_ = std::move(why);
  abandon_by_ = by;
  abandon_ = true;
}

void Promoter::SupersedeRankBelow(const std::string& job, std::uint32_t rank, std::uint64_t version) {
  std::vector<Skipped> skipped;
  {
    MutexLock lock(mu_);
    // Older versions of the job cannot commit without this rank's: those still to come go
    // too, as they arrive.
    JobState& j = jobs_[job];
    j.newest = std::max(j.newest, version);
    auto why = [&](const ShardMeta& m) {
      return ShardName(m) + " was not persisted: superseded by version " + std::to_string(version) +
             " before it was persisted (rank " + std::to_string(rank) +
             " restarted, and its restart waits for its newest version only)";
    };
    if (running_) AbandonRunningLocked(job, rank, version, why(running_meta_), version);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->meta.job != job || it->meta.rank != rank || it->meta.version >= version) {
        ++it;
        continue;
      }
      std::string w = why(it->meta);
      skipped.push_back({std::move(*it), std::move(w), version});
      it = queue_.erase(it);
    }
  }
  Skip(std::move(skipped));
}

void Promoter::RankRegistered(const std::string& job, std::uint32_t rank) {
  std::vector<Skipped> skipped;
  {
    MutexLock lock(mu_);
    jobs_.erase(job);
    if (running_) {
      AbandonRunningLocked(
          job, rank, 0,
          ShardName(running_meta_) + " was not persisted: rank " + std::to_string(rank) +
              " registered again (a restart or a restore) before it was, so it can no longer "
              "commit",
          0);
    }
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->meta.job != job || it->meta.rank != rank) {
        ++it;
        continue;
      }
      std::string why =
          ShardName(it->meta) + " was not persisted: rank " + std::to_string(rank) +
          " registered again (a restart or a restore) before it was, so it can no longer commit";
      skipped.push_back({std::move(*it), std::move(why), 0});
      it = queue_.erase(it);
    }
  }
  Skip(std::move(skipped));
}

void Promoter::Skip(std::vector<Skipped> skipped) {
  for (auto& [task, why, by] : skipped) {
    Supersede(task, why, by);
    local_.Unpin(task.meta.job, task.meta.version);
  }
}

void Promoter::Supersede(const Task& task, const std::string& why, std::uint64_t by) {
  const ShardMeta& m = task.meta;
  // It will not commit: its image has no reader left.
  if (auto image = memory_.Find(m.job, m.version, m.rank); image && image->meta.session == m.session) {
    memory_.Drop(image);
  }
  spdlog::info("{}", why);
  if (task.shard) {
    task.shard->Skip(FailedPrecondition(why), by);
    hooks_.on_superseded(task.shard);
  }
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
      running_meta_ = task.meta;
      abandon_ = false;
      auto& started = jobs_[task.meta.job].started;
      started.insert(task.meta.version);
      while (started.size() > kStartedKept) started.erase(started.begin());
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
                          m.version, &abandon_};
  const auto start = std::chrono::steady_clock::now();
  std::optional<DifferentialPlan> plan;
  if (bases_ != nullptr && bases_->base_every() > 0) {
    struct stat st {};
    Result<ShardInfo> full = Status::Ok();
    if (src.image) {
      full = ParseImageHeader(*src.image);
    } else if (auto fd = OpenRegularForRead(src.path); !fd.ok()) {
      full = fd.status();
    } else if (::fstat(fd->get(), &st) != 0) {
      full = IoError("stat " + src.path, errno);
    } else {
      full = ReadShardHeader(fd->get(), src.path);
    }
    if (full.ok()) {
      plan = bases_->Plan(full.value());
      if (plan && !src.image) {
        plan->source_dev = static_cast<std::uint64_t>(st.st_dev);
        plan->source_ino = static_cast<std::uint64_t>(st.st_ino);
      }
    } else {
      spdlog::warn("{}: written whole, its header could not be read for a differential write: {}", ShardName(m),
                   full.status().message());
    }
  }
  dst.differential = plan ? &*plan : nullptr;
  // A failed copy leaves its reference: another rank of this node may read from the same base
  // (one reference per node and version).
  auto copied = copier_.Copy(src, dst);
  if (!copied.ok() && abandon_) {
    std::string why;
    std::uint64_t by = 0;
    {
      MutexLock lock(mu_);
      why = abandon_why_;
      by = abandon_by_;
    }
    Supersede(task, why, by);
    return;
  }
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
  const std::uint64_t written = plan ? plan->file_bytes : task.file_bytes;
  metrics::Metrics().Promoted(written,
                              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (plan) {
    spdlog::info("{} persisted differential over base version {}: {} of {} item bytes written ({} bytes in all)",
                 ShardName(m), plan->base, plan->stored_bytes, plan->item_bytes, written);
  } else if (bases_ != nullptr) {
    bases_->PersistedWhole(m);
  }
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
