#include "daemon/tiers/memory_tier.h"
#include "common/align.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

namespace ckpt {
namespace {

constexpr std::uint64_t kPage = 4096;

}  // namespace

struct MemoryTier::Store {
  struct Buffer {
    char* data;
    std::uint64_t capacity;
  };
  Mutex mu;
  std::vector<Buffer> free;
  std::uint64_t accounted = 0;  // buffers in use + free ones

  ~Store() {
    for (const auto& b : free) ::munmap(b.data, b.capacity);
  }

  // A buffer of at least `bytes` (page multiple) within `budget`, or nullptr.
  char* Take(std::uint64_t bytes, std::uint64_t budget, std::uint64_t* capacity) {
    MutexLock lock(mu);
    // Reuse a freed buffer of the right size: steady-state checkpoints of one size never
    // fault in fresh pages.
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->capacity >= bytes && it->capacity <= 2 * bytes &&
          (best == free.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best != free.end()) {
      Buffer b = *best;
      free.erase(best);
      *capacity = b.capacity;
      return b.data;
    }
    // Make room by unmapping freed buffers, then map a new one; unmap nothing if even that
    // would not make room (the buffers stay for reuse).
    std::uint64_t freeable = 0;
    for (const auto& b : free) freeable += b.capacity;
    if (accounted - freeable + bytes > budget) return nullptr;
    while (accounted + bytes > budget && !free.empty()) {
      ::munmap(free.back().data, free.back().capacity);
      accounted -= free.back().capacity;
      free.pop_back();
    }
    if (accounted + bytes > budget) return nullptr;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    accounted += bytes;
    *capacity = bytes;
    return static_cast<char*>(p);
  }

  // Bytes a Take could have without anything else giving way (freed buffers count: Take
  // unmaps them).
  std::uint64_t Headroom(std::uint64_t budget) {
    MutexLock lock(mu);
    std::uint64_t freeable = 0;
    for (const auto& b : free) freeable += b.capacity;
    const std::uint64_t held = accounted - freeable;
    return held >= budget ? 0 : budget - held;
  }

  void Give(char* data, std::uint64_t capacity) {
    MutexLock lock(mu);
    free.push_back(Buffer{data, capacity});
  }
};

MemoryTier::MemoryTier(std::uint64_t budget_bytes, std::uint32_t versions, LiveCheck is_live)
    : budget_(budget_bytes),
      versions_(versions),
      is_live_(std::move(is_live)),
      store_(std::make_shared<Store>()) {}

MemoryTier::~MemoryTier() = default;

std::shared_ptr<MemoryImage> MemoryTier::Reserve(const ShardMeta& meta, std::uint64_t file_bytes) {
  if (!enabled()) return nullptr;
  const std::uint64_t bytes = AlignUp(std::max<std::uint64_t>(file_bytes, 1), kPage);
  {
    MutexLock lock(mu_);
    auto& versions = images_[Key{meta.job, meta.rank}];
    // The same version written again (after a rollback or a failure): the old image goes.
    if (auto it = versions.find(meta.version); it != versions.end()) versions.erase(it);
    // Uncommitted images older than the newest committed one will never be needed.
    PruneLocked(versions);
  }
  std::uint64_t capacity = 0;
  char* data = store_->Take(bytes, budget_, &capacity);
  while (data == nullptr) {
    // Short of room: the newest version matters most (it is what a restarting trainer
    // wants), so older versions of this rank still in flight give way, oldest first. The
    // committed ones the rules keep never do.
    {
      MutexLock lock(mu_);
      auto& versions = images_[Key{meta.job, meta.rank}];
      auto victim = std::find_if(versions.begin(), versions.end(), [&](const auto& e) {
        return !e.second.committed && e.first < meta.version;
      });
      if (victim == versions.end()) break;
      versions.erase(victim);  // its buffer returns once no restore or promotion uses it
    }
    data = store_->Take(bytes, budget_, &capacity);
  }
  // Then replicas of other daemons' shards: own shards come first.
  while (data == nullptr) {
    {
      MutexLock lock(mu_);
      if (!DropOneReplicaLocked(Key{}, 0)) break;
    }
    data = store_->Take(bytes, budget_, &capacity);
  }
  if (data == nullptr) data = TakeFromFinished(meta, bytes, &capacity);
  if (data == nullptr) {
    WarnNotKept(meta, file_bytes);
    return nullptr;
  }
  auto image = MakeImage(meta, file_bytes, data, bytes, capacity);
  MutexLock lock(mu_);
  images_[Key{meta.job, meta.rank}][meta.version] = Entry{image, false, ""};
  TouchLocked(Key{meta.job, meta.rank});
  return image;
}

std::shared_ptr<MemoryImage> MemoryTier::MakeImage(const ShardMeta& meta, std::uint64_t file_bytes, char* data,
                                                   std::uint64_t bytes, std::uint64_t capacity) {
  // The padding past the file's end must be zero: it is written with O_DIRECT.
  if (bytes > file_bytes) std::memset(data + file_bytes, 0, bytes - file_bytes);
  std::weak_ptr<Store> store = store_;
  return std::shared_ptr<MemoryImage>(new MemoryImage(meta, file_bytes, data, capacity),
                                      [store](MemoryImage* img) {
                                        if (auto s = store.lock()) {
                                          s->Give(img->data(), img->capacity());
                                        } else {
                                          ::munmap(img->data(), img->capacity());
                                        }
                                        delete img;
                                      });
}

bool MemoryTier::DropOneReplicaLocked(const Key& prefer, std::uint64_t below) {
  if (auto it = images_.find(prefer); it != images_.end()) {
    for (auto v = it->second.begin(); v != it->second.end() && v->first < below; ++v) {
      if (!v->second.origin.empty()) {
        it->second.erase(v);
        return true;
      }
    }
  }
  const Key* victim = nullptr;
  std::uint64_t victim_used = 0;
  for (const auto& [key, versions] : images_) {
    // `prefer`'s replicas are all as new as `below` or newer: never dropped for an older one.
    if (below != 0 && key == prefer) continue;
    const bool has = std::any_of(versions.begin(), versions.end(),
                                 [](const auto& e) { return !e.second.origin.empty(); });
    if (!has) continue;
    const std::uint64_t used = last_used_[key];
    if (victim == nullptr || used < victim_used) {
      victim = &key;
      victim_used = used;
    }
  }
  if (victim == nullptr) return false;
  auto& versions = images_[*victim];
  for (auto v = versions.begin(); v != versions.end(); ++v) {
    if (!v->second.origin.empty()) {
      versions.erase(v);  // its oldest replica; the buffer returns once no restore or send uses it
      break;
    }
  }
  return true;
}

bool MemoryTier::DropOlderReplicaLocked(const Key& key, std::uint64_t below, std::uint64_t keep) {
  auto it = images_.find(key);
  if (it == images_.end()) return false;
  for (auto v = it->second.begin(); v != it->second.end() && v->first < below; ++v) {
    // One still in use (a restore or a send reads it) would free nothing now.
    if (!v->second.origin.empty() && v->first != keep && v->second.image.use_count() == 1) {
      it->second.erase(v);
      return true;
    }
  }
  return false;
}

std::shared_ptr<MemoryImage> MemoryTier::ReserveReplica(const ShardMeta& meta, std::uint64_t file_bytes,
                                                        const std::string& origin, bool* own_shard,
                                                        std::uint64_t delta_base) {
  if (own_shard != nullptr) *own_shard = false;
  if (!enabled()) return nullptr;
  const std::uint64_t bytes = AlignUp(std::max<std::uint64_t>(file_bytes, 1), kPage);
  const Key key{meta.job, meta.rank};
  {
    MutexLock lock(mu_);
    auto& versions = images_[key];
    if (auto it = versions.find(meta.version); it != versions.end()) {
      // This daemon's own shard of that version is here (complete, or being captured): a
      // replica adds nothing and must not take its place.
      if (it->second.origin.empty()) {
        if (own_shard != nullptr) *own_shard = true;
        return nullptr;
      }
      versions.erase(it);  // an older replica of it, replaced
    }
    PruneLocked(versions);
  }
  std::uint64_t capacity = 0;
  char* data = store_->Take(bytes, budget_, &capacity);
  if (data == nullptr && delta_base != 0) {
    // Refused before anything is dropped if the replicas that may give way would not make
    // the room: a refused delta must not cost the peer its older versions for nothing.
    MutexLock lock(mu_);
    std::uint64_t reclaimable = 0;
    if (auto it = images_.find(key); it != images_.end()) {
      for (const auto& [v, e] : it->second) {
        if (v < meta.version && v != delta_base && !e.origin.empty() && e.image.use_count() == 1)
          reclaimable += e.image->capacity();
      }
    }
    if (store_->Headroom(budget_) + reclaimable < bytes) return nullptr;
  }
  while (data == nullptr) {
    {
      MutexLock lock(mu_);
      const bool dropped = delta_base != 0 ? DropOlderReplicaLocked(key, meta.version, delta_base)
                                           : DropOneReplicaLocked(key, meta.version);
      if (!dropped) break;
    }
    data = store_->Take(bytes, budget_, &capacity);
  }
  if (data == nullptr) return nullptr;
  auto image = MakeImage(meta, file_bytes, data, bytes, capacity);
  MutexLock lock(mu_);
  auto& versions = images_[key];
  versions[meta.version] = Entry{image, false, origin};
  // At most versions_ + 1 replicas per rank (the committed ones kept and one in flight):
  // the holder may not see every commit of the job, so the count bounds them too.
  std::size_t replicas = 0;
  for (const auto& [v, e] : versions) replicas += e.origin.empty() ? 0 : 1;
  for (auto it = versions.begin(); replicas > versions_ + 1 && it != versions.end();) {
    if (!it->second.origin.empty() && it->first != meta.version) {
      it = versions.erase(it);
      --replicas;
    } else {
      ++it;
    }
  }
  TouchLocked(key);
  return image;
}

std::uint32_t MemoryTier::DropReplicas(const std::string& job, const std::string& origin) {
  std::uint32_t dropped = 0;
  MutexLock lock(mu_);
  for (auto& [key, versions] : images_) {
    if (std::get<0>(key) != job) continue;
    for (auto it = versions.begin(); it != versions.end();) {
      if (!it->second.origin.empty() && (origin.empty() || it->second.origin == origin)) {
        it = versions.erase(it);
        ++dropped;
      } else {
        ++it;
      }
    }
  }
  return dropped;
}

std::uint32_t MemoryTier::DropJob(const std::string& job, std::uint64_t newest_committed,
                                  std::uint64_t* bytes) {
  std::uint32_t dropped = 0;
  *bytes = 0;
  MutexLock lock(mu_);
  for (auto it = images_.begin(); it != images_.end();) {
    if (std::get<0>(it->first) != job) {
      ++it;
      continue;
    }
    auto& versions = it->second;
    for (auto v = versions.begin(); v != versions.end();) {
      // A version newer than the newest committed one is still on its way (its commit may
      // wait for its replicas, which its image is sent from): it stays, and goes by the
      // tier's usual rules once committed or failed.
      if (v->second.image->complete && v->first <= newest_committed) {
        *bytes += v->second.image->capacity();
        v = versions.erase(v);
        ++dropped;
      } else {
        ++v;
      }
    }
    if (versions.empty()) {
      last_used_.erase(it->first);
      it = images_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

std::map<std::string, std::uint64_t> MemoryTier::ReplicaBytes() {
  std::map<std::string, std::uint64_t> out;
  MutexLock lock(mu_);
  for (const auto& [key, versions] : images_) {
    for (const auto& [v, e] : versions) {
      if (!e.origin.empty() && e.image->complete) out[e.origin] += e.image->capacity();
    }
  }
  return out;
}

char* MemoryTier::TakeFromFinished(const ShardMeta& meta, std::uint64_t bytes, std::uint64_t* capacity) {
  if (!is_live_) return nullptr;
  const Key asking{meta.job, meta.rank};
  std::set<std::string> dropped_jobs;
  char* data = nullptr;
  while (data == nullptr) {
    // The ranks holding images, least recently used job first (a job's use: its ranks' newest).
    std::vector<std::tuple<std::uint64_t, std::uint64_t, Key>> held;
    {
      MutexLock lock(mu_);
      std::map<std::string, std::uint64_t> job_used;
      for (const auto& [key, versions] : images_) {
        if (versions.empty()) continue;
        auto& used = job_used[std::get<0>(key)];
        used = std::max(used, last_used_[key]);
      }
      for (const auto& [key, versions] : images_) {
        if (!versions.empty() && key != asking)
          held.emplace_back(job_used[std::get<0>(key)], last_used_[key], key);
      }
    }
    std::sort(held.begin(), held.end());
    // Asked outside the lock: the session table has locks of its own.
    const Key* victim = nullptr;
    for (const auto& [job_used, used, key] : held) {
      if (!is_live_(std::get<0>(key), std::get<1>(key))) {
        victim = &key;
        break;
      }
    }
    if (victim == nullptr) break;
    {
      MutexLock lock(mu_);
      auto it = images_.find(*victim);
      if (it != images_.end() && !it->second.empty()) {
        it->second.erase(it->second.begin());  // its oldest version; the buffer returns when unused
        if (it->second.empty()) {
          images_.erase(it);
          last_used_.erase(*victim);
        }
      }
    }
    if (dropped_jobs.insert(std::get<0>(*victim)).second) {
      spdlog::info(
          "memory tier: dropping the images of job {} (no live session, least recently used) to keep job {} "
          "version {} rank {}",
          std::get<0>(*victim), meta.job, meta.version, meta.rank);
    }
    data = store_->Take(bytes, budget_, capacity);
  }
  return data;
}

void MemoryTier::WarnNotKept(const ShardMeta& meta, std::uint64_t file_bytes) {
  std::map<std::string, std::uint64_t> held_by;  // job -> bytes of its images
  std::uint64_t not_kept = 0;
  {
    MutexLock lock(mu_);
    ++not_kept_;
    const auto now = std::chrono::steady_clock::now();
    if (warned_ != std::chrono::steady_clock::time_point{} && now - warned_ < std::chrono::minutes(1)) {
      spdlog::debug("memory tier: job {} version {} rank {} ({} bytes) not kept", meta.job, meta.version,
                    meta.rank, file_bytes);
      return;
    }
    warned_ = now;
    not_kept = std::exchange(not_kept_, 0);
    for (const auto& [key, versions] : images_) {
      for (const auto& [v, e] : versions) held_by[std::get<0>(key)] += e.image->capacity();
    }
  }
  std::string holders;
  std::uint64_t held = 0;
  for (const auto& [job, b] : held_by) {
    holders += (holders.empty() ? "" : ", ") + job + " " + std::to_string(b >> 20) + " MiB";
    held += b;
  }
  const std::uint64_t accounted = GetStats().bytes;
  std::string why;
  if (file_bytes > budget_) {
    why = "it is larger than the whole budget";
  } else {
    why = "the rest is held by images of running jobs, which are kept (" +
          (holders.empty() ? std::string("none") : holders) + ")";
    if (accounted > held) {
      why += " and " + std::to_string((accounted - held) >> 20) +
             " MiB by images still in use (shards being written, restores, promotions)";
    }
    why += "; size --memory-mib for --memory-versions + 1 versions of every rank running at once";
  }
  spdlog::warn(
      "memory tier: job {} version {} rank {} ({} MiB) not kept within the {} MiB budget ({} shard(s) not "
      "kept since the last warning): {}; restores of versions not kept read the local or persistent tier",
      meta.job, meta.version, meta.rank, file_bytes >> 20, budget_ >> 20, not_kept, why);
}

void MemoryTier::Complete(const std::shared_ptr<MemoryImage>& image) {
  if (image) image->complete = true;
}

void MemoryTier::Drop(const std::shared_ptr<MemoryImage>& image) {
  if (!image) return;
  MutexLock lock(mu_);
  auto it = images_.find(Key{image->meta.job, image->meta.rank});
  if (it == images_.end()) return;
  auto v = it->second.find(image->meta.version);
  if (v != it->second.end() && v->second.image == image) it->second.erase(v);
}

void MemoryTier::PruneLocked(std::map<std::uint64_t, Entry>& versions) {
  std::uint32_t committed_seen = 0;
  std::uint64_t newest_committed = 0;
  // Newest first: keep `versions_` committed images and anything newer than the newest
  // committed one (in flight); drop the rest.
  for (auto it = versions.rbegin(); it != versions.rend();) {
    bool drop = false;
    if (it->second.committed) {
      if (newest_committed == 0) newest_committed = it->first;
      drop = ++committed_seen > versions_;
    } else {
      drop = newest_committed != 0;  // older than a committed version
    }
    if (drop) {
      it = std::make_reverse_iterator(versions.erase(std::next(it).base()));
    } else {
      ++it;
    }
  }
}

void MemoryTier::OnCommitted(const std::string& job, std::uint64_t version) {
  MutexLock lock(mu_);
  for (auto& [key, versions] : images_) {
    if (std::get<0>(key) != job) continue;
    if (auto it = versions.find(version); it != versions.end() && it->second.image->complete) {
      it->second.committed = true;
    }
    PruneLocked(versions);
  }
}

std::uint32_t MemoryTier::DropNewerThan(const std::string& job, std::uint32_t rank, std::uint64_t version) {
  MutexLock lock(mu_);
  auto it = images_.find(Key{job, rank});
  if (it == images_.end()) return 0;
  const auto from = it->second.upper_bound(version);
  const auto n = static_cast<std::uint32_t>(std::distance(from, it->second.end()));
  it->second.erase(from, it->second.end());
  return n;
}

std::shared_ptr<MemoryImage> MemoryTier::Find(const std::string& job, std::uint64_t version,
                                              std::uint32_t rank) {
  MutexLock lock(mu_);
  auto it = images_.find(Key{job, rank});
  if (it == images_.end()) return nullptr;
  auto v = it->second.find(version);
  if (v == it->second.end() || !v->second.image->complete) return nullptr;
  TouchLocked(it->first);
  return v->second.image;
}

std::shared_ptr<MemoryImage> MemoryTier::FindReplica(const std::string& job, std::uint64_t version,
                                                     std::uint32_t rank, const std::string& origin) {
  MutexLock lock(mu_);
  auto it = images_.find(Key{job, rank});
  if (it == images_.end()) return nullptr;
  auto v = it->second.find(version);
  if (v == it->second.end() || !v->second.image->complete || origin.empty() || v->second.origin != origin) {
    return nullptr;
  }
  TouchLocked(it->first);
  return v->second.image;
}

std::map<std::uint64_t, std::vector<std::uint32_t>> MemoryTier::List(const std::string& job) {
  std::map<std::uint64_t, std::vector<std::uint32_t>> out;
  MutexLock lock(mu_);
  for (const auto& [key, versions] : images_) {
    if (std::get<0>(key) != job) continue;
    for (const auto& [v, e] : versions) {
      if (e.image->complete && e.origin.empty()) out[v].push_back(std::get<1>(key));
    }
  }
  for (auto& [v, ranks] : out) std::sort(ranks.begin(), ranks.end());
  return out;
}

std::map<std::uint64_t, std::vector<std::pair<std::uint32_t, std::string>>> MemoryTier::ListReplicas(
    const std::string& job) {
  std::map<std::uint64_t, std::vector<std::pair<std::uint32_t, std::string>>> out;
  MutexLock lock(mu_);
  for (const auto& [key, versions] : images_) {
    if (std::get<0>(key) != job) continue;
    for (const auto& [v, e] : versions) {
      if (e.image->complete && !e.origin.empty()) out[v].emplace_back(std::get<1>(key), e.origin);
    }
  }
  for (auto& [v, ranks] : out) std::sort(ranks.begin(), ranks.end());
  return out;
}

std::vector<MemoryTier::ReplicaEntry> MemoryTier::ReplicasFrom(const std::string& job, const std::string& origin) {
  std::vector<ReplicaEntry> out;
  MutexLock lock(mu_);
  for (const auto& [key, versions] : images_) {
    if (std::get<0>(key) != job) continue;
    for (const auto& [v, e] : versions) {
      if (e.image->complete && e.origin == origin) out.push_back({v, std::get<1>(key), e.image->file_bytes});
    }
  }
  return out;
}

MemoryTier::Stats MemoryTier::GetStats() {
  Stats st;
  st.budget = budget_;
  {
    MutexLock lock(mu_);
    for (const auto& [key, versions] : images_) st.images += versions.size();
  }
  MutexLock lock(store_->mu);
  st.bytes = store_->accounted;
  return st;
}

MemoryTier::Usage MemoryTier::GetUsage() {
  Usage u;
  u.budget = budget_;
  // Both locks, in the tier's order (an erase under mu_ may free a buffer into the store):
  // the images counted and the store's figures are of one moment.
  MutexLock lock(mu_);
  for (const auto& [key, versions] : images_) {
    for (const auto& [v, e] : versions) {
      if (!e.image->complete) continue;
      JobUsage& j = u.jobs[std::get<0>(key)];
      (e.origin.empty() ? j.shards : j.replica_shards) += 1;
      (e.origin.empty() ? j.bytes : j.replica_bytes) += e.image->capacity();
      u.held += e.image->capacity();
    }
  }
  MutexLock store(store_->mu);
  u.accounted = store_->accounted;
  for (const auto& b : store_->free) u.reusable += b.capacity;
  u.in_flight = u.accounted - u.held - u.reusable;
  return u;
}

std::uint64_t MemoryTier::HeldBytes(const std::string& job, std::uint64_t version, std::uint32_t rank) {
  MutexLock lock(mu_);
  auto it = images_.find(Key{job, rank});
  if (it == images_.end()) return 0;
  auto e = it->second.find(version);
  if (e == it->second.end() || !e->second.origin.empty() || !e->second.image->complete) return 0;
  return e->second.image->capacity();
}

}  // namespace ckpt
