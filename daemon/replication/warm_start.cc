#include "daemon/replication/warm_start.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>
#include <string_view>

#include "common/names.h"
#include "daemon/replication/erasure_group.h"
#include "daemon/replication/peer_protocol.h"
#include "format/checksum.h"
#include "format/shard_format.h"

namespace ckpt {
namespace {

// Every item of a received image against the header's checksum, and the header against the
// shard asked for: what a restore checks before it writes a byte, done before the image
// counts as held, so that a memory-tier image is never a bad copy a restore must pass over.
Status VerifyImage(const MemoryImage& image, const std::string& job, std::uint64_t version, std::uint32_t rank) {
  const std::string what = DescribeShard(job, version, rank);
  if (image.file_bytes < 8) return DataLoss(what + ": the image is shorter than its header's prefix");
  std::uint64_t header = 0;  // the 8-byte little-endian prefix of safetensors
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(image.data()[i]);
  if (header > image.file_bytes - 8) return DataLoss(what + ": the header runs past the image");
  auto info = ParseShardHeader(std::string_view(image.data() + 8, header), image.file_bytes);
  if (!info.ok()) return info.status().With(what);
  if (info->meta.job != job || info->meta.version != version || info->meta.rank != rank) {
    return DataLoss(what + ": the image is of " +
                    DescribeShard(info->meta.job, info->meta.version, info->meta.rank));
  }
  for (const auto& item : info->items) {
    const std::uint64_t at = info->data_start + item.offset;
    if (at > image.file_bytes || item.length > image.file_bytes - at) {
      return DataLoss(what + ": item " + QuoteName(item.name) + " runs past the image");
    }
    const std::uint64_t sum = Checksum::Of(image.data() + at, item.length);
    if (sum != item.checksum) {
      return DataLoss(what + ": checksum mismatch in item " + QuoteName(item.name) + " (stored " +
                      ChecksumHex(item.checksum) + ", computed " + ChecksumHex(sum) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

const char* WarmStateName(WarmShardProgress::State state) {
  switch (state) {
    case WarmShardProgress::State::kPending:
      return "pending";
    case WarmShardProgress::State::kRunning:
      return "running";
    case WarmShardProgress::State::kDone:
      return "done";
    case WarmShardProgress::State::kFailed:
      return "failed";
  }
  return "unknown";
}

WarmStart::WarmStart(Replicator& peers, TierSet& tiers, std::uint64_t bytes_per_s,
                     std::function<void(const std::string&)> error)
    : peers_(peers), tiers_(tiers), bytes_per_s_(bytes_per_s), error_(std::move(error)) {
  thread_ = std::thread([this] { Loop(); });
}

WarmStart::~WarmStart() { Stop(); }

void WarmStart::Stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  cancel_ = true;
  if (thread_.joinable()) thread_.join();
}

Result<WarmStartPlan> WarmStart::Start(const std::string& job, std::vector<std::uint32_t> ranks) {
  MemoryTier& memory = tiers_.memory();
  if (!memory.enabled()) {
    return FailedPrecondition("this daemon has no memory tier (--memory-mib 0): a warm start has nowhere to go");
  }
  {
    MutexLock lock(mu_);
    for (const auto& j : jobs_) {
      if (j->job == job && (j->state == WarmShardProgress::State::kPending ||
                            j->state == WarmShardProgress::State::kRunning)) {
        return FailedPrecondition("a warm start of job '" + job + "' (version " + std::to_string(j->version) +
                                  ") is still " + WarmStateName(j->state) + " (`ckptctl status` shows it)");
      }
    }
  }
  auto held = tiers_.HoldCommitted(job, 0);
  if (!held.ok()) return held.status();
  const std::uint64_t version = held->version;
  // What each peer holds of the version as sent by this daemon's address: the ranks of the
  // node this one replaces, and where to read each (ring order: the rule's holders first).
  std::map<std::uint32_t, std::vector<std::string>> where;
  std::map<std::uint32_t, std::uint64_t> sizes;
  std::vector<std::string> silent;
  for (std::size_t i : peers_.peers().Ring()) {
    const std::string& peer = peers_.peers().addresses[i];
    auto listed = peers_.ReplicasSentFrom(peer, job);
    if (!listed.ok()) {
      silent.push_back(listed.status().message());  // names the peer
      continue;
    }
    for (const auto& r : listed.value()) {
      if (r.version != version) continue;
      where[r.rank].push_back(peer);
      sizes[r.rank] = r.file_bytes;
    }
  }
  for (const auto& s : silent) {
    if (error_) error_("warm start of job " + job + ": " + s);
  }
  if (ranks.empty()) {
    for (const auto& [rank, peers] : where) ranks.push_back(rank);
    if (ranks.empty() && !silent.empty()) {
      // Say why rather than "nothing held": a secret that does not match, peers down.
      std::string who;
      for (const auto& x : silent) who += (who.empty() ? "" : "; ") + x;
      return FailedPrecondition("warm start of job '" + job + "': no peer holds a shard of version " +
                                std::to_string(version) + " sent by this daemon, and " +
                                std::to_string(silent.size()) + " could not say: " + who);
    }
    if (ranks.empty()) {
      return NotFound("no peer holds a shard of version " + std::to_string(version) + " of job '" + job +
                      "' sent by this daemon (" + peers_.peers().self_address() +
                      "): name the ranks (--ranks) to pull them from any peer holding them");
    }
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  auto progress = std::make_shared<WarmJobProgress>();
  progress->job = job;
  progress->version = version;
  auto hold = std::make_shared<HeldVersion>(std::move(held).value());
  std::vector<Task> tasks;
  for (std::uint32_t rank : ranks) {
    if (memory.Find(job, version, rank)) continue;  // held already
    WarmShardProgress shard;
    shard.rank = rank;
    if (auto it = sizes.find(rank); it != sizes.end()) shard.total_bytes = it->second;
    progress->shards.push_back(shard);
    Task t;
    t.job = progress;
    t.shard = progress->shards.size() - 1;
    if (auto it = where.find(rank); it != where.end()) t.peers = it->second;
    t.held = hold;
    tasks.push_back(std::move(t));
  }
  WarmStartPlan plan;
  plan.version = version;
  plan.shards = static_cast<std::uint32_t>(progress->shards.size());
  for (const auto& s : progress->shards) plan.total_bytes += s.total_bytes;
  Summarize(*progress);
  MutexLock lock(mu_);
  if (stopping_) return Cancelled("the daemon is stopping");
  if (queue_.size() + tasks.size() > kMaxQueuedShards) {
    return ResourceExhausted("warm start of job '" + job + "': " + std::to_string(queue_.size()) +
                             " shard(s) are already waiting to be pulled (at most " +
                             std::to_string(kMaxQueuedShards) + "); ask again once they are done");
  }
  jobs_.push_back(progress);
  while (jobs_.size() > kJobsKept) jobs_.pop_front();  // a task still holds its job
  for (auto& t : tasks) queue_.push_back(std::move(t));
  changed_.SignalAll();
  spdlog::info("warm start of job {}: version {}, {} shard(s), {} bytes to pull from peers", job, version,
               plan.shards, plan.total_bytes);
  return plan;
}

void WarmStart::StartAll() {
  MutexLock lock(mu_);
  start_all_ = true;
  changed_.SignalAll();
}

void WarmStart::Summarize(WarmJobProgress& job) {
  job.bytes_done = job.total_bytes = 0;
  std::size_t done = 0, failed = 0, pending = 0;
  std::string first_error;
  for (const auto& s : job.shards) {
    job.bytes_done += s.bytes_done;
    job.total_bytes += s.total_bytes;
    if (s.state == WarmShardProgress::State::kDone) ++done;
    if (s.state == WarmShardProgress::State::kPending) ++pending;
    if (s.state == WarmShardProgress::State::kFailed) {
      if (first_error.empty()) first_error = "rank " + std::to_string(s.rank) + ": " + s.error;
      ++failed;
    }
  }
  const std::size_t n = job.shards.size();
  if (done + failed == n) {
    job.state = failed > 0 ? WarmShardProgress::State::kFailed : WarmShardProgress::State::kDone;
  } else {
    job.state = pending == n ? WarmShardProgress::State::kPending : WarmShardProgress::State::kRunning;
  }
  job.error = failed == 0 ? std::string()
                          : std::to_string(failed) + " of " + std::to_string(n) +
                                " shard(s) not pulled (their restore reads the next source): " + first_error;
}

void WarmStart::SetShard(const Task& task, const std::function<void(WarmShardProgress&)>& change) {
  MutexLock lock(mu_);
  change(task.job->shards[task.shard]);
  Summarize(*task.job);
}

void WarmStart::Loop() {
  for (;;) {
    Task task;
    bool all = false;
    {
      MutexLock lock(mu_);
      while (!stopping_ && queue_.empty() && !start_all_) changed_.Wait(mu_);
      if (stopping_) return;
      if (start_all_) {
        start_all_ = false;
        all = true;
      } else {
        task = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (all) {
      auto jobs = tiers_.persistent().Jobs();
      if (!jobs.ok()) {
        if (error_) error_("warm start: cannot list the jobs under the root: " + jobs.status().message());
        continue;
      }
      for (const auto& job : jobs.value()) {
        if (cancel_) return;  // each job's question to the peers may take their deadline
        auto plan = Start(job, {});
        if (plan.ok()) continue;
        // No shard of this node's (a job that ran elsewhere) is the common case, not an error.
        if (plan.status().code() == StatusCode::kNotFound) {
          spdlog::info("warm start: job {} passed over: {}", job, plan.status().message());
        } else if (error_) {
          error_(plan.status().message());
        }
      }
      continue;
    }
    Pull(task);
  }
}

void WarmStart::Pace(std::uint64_t bytes) {
  if (bytes_per_s_ == 0) return;
  // A budget that refills at bytes_per_s_: each piece moves the time it may end by; a pull
  // ahead of it sleeps the difference (no burst is saved up while idle).
  const auto now = std::chrono::steady_clock::now();
  if (paced_until_ < now) paced_until_ = now;
  paced_until_ += std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / static_cast<double>(bytes_per_s_)));
  if (paced_until_ > now && !cancel_) std::this_thread::sleep_until(paced_until_);
}

void WarmStart::Pull(Task& task) {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t rank = 0;
  {
    MutexLock lock(mu_);
    job = task.job->job;
    version = task.job->version;
    rank = task.job->shards[task.shard].rank;
  }
  MemoryTier& memory = tiers_.memory();
  const std::string what = DescribeShard(job, version, rank);
  if (memory.Find(job, version, rank)) {  // a restore or a trainer put it there meanwhile
    SetShard(task, [](WarmShardProgress& s) { s.state = WarmShardProgress::State::kDone; });
    shards_done_++;
    return;
  }
  std::vector<std::string> peers = task.peers;
  if (peers.empty()) peers = peers_.Holding(job, version, rank);
  // A rebuild from the erasure-coding group is a restore's source, not a warm start's (it
  // reads from every daemon of the group; the restore does it when a trainer asks).
  std::erase(peers, std::string(ErasureGroup::kSource));
  std::string errors;
  for (const std::string& peer : peers) {
    if (cancel_) return;
    SetShard(task, [&](WarmShardProgress& s) {
      s.state = WarmShardProgress::State::kRunning;
      s.peer = peer;
      s.bytes_done = 0;
    });
    std::shared_ptr<MemoryImage> reserved;
    Replicator::FetchOptions options;
    // The room of an own shard: the rank is this node's, and its restore will read it here.
    options.make = [&](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) {
      reserved = memory.Reserve(meta, file_bytes);
      if (!reserved) {
        *why = "no room for " + what + " (" + std::to_string(file_bytes >> 20) +
               " MiB) in this daemon's memory tier (--memory-mib " + std::to_string(memory.GetStats().budget >> 20) +
               ")";
      } else {
        SetShard(task, [&](WarmShardProgress& s) { s.total_bytes = file_bytes; });
      }
      return reserved;
    };
    options.on_piece = [&](std::uint64_t n) {
      bytes_total_ += n;
      SetShard(task, [&](WarmShardProgress& s) { s.bytes_done += n; });
      Pace(n);
    };
    options.cancel = &cancel_;
    auto image = peers_.FetchWith(peer, job, version, rank, options);
    Status st = image.ok() ? VerifyImage(*image.value(), job, version, rank) : image.status();
    if (st.ok()) {
      memory.Complete(image.value());
      memory.OnCommitted(job, version);
      SetShard(task, [](WarmShardProgress& s) {
        s.state = WarmShardProgress::State::kDone;
        s.error.clear();
      });
      shards_done_++;
      spdlog::info("warm start: {} pulled from peer {} ({} bytes)", what, peer, image.value()->file_bytes);
      return;
    }
    // Only a complete, verified image counts: whatever was received is let go.
    if (reserved) memory.Drop(reserved);
    if (cancel_) return;
    const std::string why = "peer " + peer + ": " + st.message();
    errors += (errors.empty() ? "" : "; ") + why;
    if (error_) error_("warm start of " + what + ": " + why + "; trying the next peer");
  }
  if (peers.empty()) errors = "no live peer holds it";
  SetShard(task, [&](WarmShardProgress& s) {
    s.state = WarmShardProgress::State::kFailed;
    s.bytes_done = 0;
    s.error = errors;
  });
  shards_failed_++;
  if (error_) error_("warm start of " + what + " failed (" + errors + "); its restore reads the next source");
}

std::vector<WarmJobProgress> WarmStart::Progress() {
  MutexLock lock(mu_);
  std::vector<WarmJobProgress> out;
  for (const auto& j : jobs_) out.push_back(*j);
  return out;
}

void WarmStart::RenderMetrics(metrics::Exposition& out) {
  std::uint64_t pending = 0, running = 0;
  {
    MutexLock lock(mu_);
    for (const auto& j : jobs_) {
      for (const auto& s : j->shards) {
        if (s.state == WarmShardProgress::State::kPending) ++pending;
        if (s.state == WarmShardProgress::State::kRunning) ++running;
      }
    }
  }
  out.Header("ckptd_warm_start_bytes_total", "counter",
             "Bytes of shard images a warm start received from peers into the memory tier (a failed transfer's "
             "included).");
  out.Sample("ckptd_warm_start_bytes_total", {}, bytes_total_.load());
  out.Header("ckptd_warm_start_shards", "gauge",
             "Shards of warm starts by state: pending and running now; done (held, verified) and failed (the "
             "restore reads the next source) since start.");
  out.Sample("ckptd_warm_start_shards", {{"state", "pending"}}, pending);
  out.Sample("ckptd_warm_start_shards", {{"state", "running"}}, running);
  out.Sample("ckptd_warm_start_shards", {{"state", "done"}}, shards_done_.load());
  out.Sample("ckptd_warm_start_shards", {{"state", "failed"}}, shards_failed_.load());
}

}  // namespace ckpt
