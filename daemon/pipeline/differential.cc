#include "daemon/pipeline/differential.h"

#include <spdlog/spdlog.h>

#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <unordered_map>

#include "common/safe_file.h"
#include "format/paths.h"
#include "format/shard_format.h"

namespace ckpt {
namespace {

// At most this many whole shards of a (job, rank) are remembered as bases: those fewer than
// N versions old, which commits lagging behind may not have made bases yet.
constexpr std::size_t kBasesKept = 64;

}  // namespace

std::optional<DifferentialPlan> PlanDifferential(const ShardInfo& full, const ShardInfo& base) {
  if (full.base || base.base) return std::nullopt;
  std::unordered_map<std::string, const ShardItem*> held;
  held.reserve(base.items.size());
  for (const ShardItem& item : base.items) held.emplace(item.TensorKey(), &item);
  std::vector<ShardItem> items = full.items;
  std::vector<std::uint64_t> from(items.size());
  std::uint64_t unchanged = 0, all = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    ShardItem& item = items[i];
    from[i] = full.data_start + item.offset;
    all += item.length;
    auto it = held.find(item.TensorKey());
    if (item.length == 0 || it == held.end()) continue;
    const ShardItem& b = *it->second;
    if (b.kind == item.kind && b.dtype == item.dtype && b.shape == item.shape && b.length == item.length &&
        b.checksum == item.checksum) {
      item.in_base = true;
      unchanged += item.length;
    }
  }
  if (unchanged == 0 || unchanged < all - unchanged) return std::nullopt;
  DifferentialPlan plan;
  plan.base = base.meta.version;
  std::uint64_t data_bytes = 0;
  auto header = RenderDifferentialHeader(full.meta, plan.base, items, &data_bytes);
  if (!header.ok()) {
    spdlog::warn("version {} of job '{}' rank {}: written whole, its differential header failed: {}",
                 full.meta.version, full.meta.job, full.meta.rank, header.status().message());
    return std::nullopt;
  }
  plan.header = std::move(header).value();
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].in_base || items[i].length == 0) continue;
    if (!plan.ranges.empty() && plan.ranges.back().from + plan.ranges.back().length == from[i]) {
      plan.ranges.back().length += items[i].length;  // contiguous in the whole shard too
    } else {
      plan.ranges.push_back({from[i], items[i].length});
    }
  }
  plan.stored_bytes = data_bytes;
  plan.item_bytes = all;
  plan.file_bytes = plan.header.size() + data_bytes;
  return plan;
}

namespace {

// The identity of the file at `path` (lstat), or nullopt.
std::optional<std::array<std::int64_t, 4>> FileIdentity(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return std::array<std::int64_t, 4>{static_cast<std::int64_t>(st.st_dev), static_cast<std::int64_t>(st.st_ino),
                                     static_cast<std::int64_t>(st.st_size),
                                     st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec};
}

bool SameFile(const std::optional<std::array<std::int64_t, 4>>& id, std::uint64_t dev, std::uint64_t ino,
              std::uint64_t size, std::int64_t mtime_ns) {
  return id && static_cast<std::uint64_t>((*id)[0]) == dev && static_cast<std::uint64_t>((*id)[1]) == ino &&
         static_cast<std::uint64_t>((*id)[2]) == size && (*id)[3] == mtime_ns;
}

}  // namespace

std::optional<BaseChooser::BaseFile> BaseChooser::BaseHeader(const ShardMeta& full, std::uint64_t base) {
  const Key key{full.job, full.rank};
  const std::string path = catalog_.ShardPath(full.job, base, full.rank);
  {
    MutexLock lock(mu_);
    auto it = headers_.find(key);
    if (it != headers_.end() && it->second.version == base) {
      const BaseFile& c = it->second;
      if (SameFile(FileIdentity(path), c.dev, c.ino, c.size, c.mtime_ns)) return c;
    }
  }
  auto fd = OpenRegularForRead(path);
  Result<ShardInfo> info = fd.ok() ? ReadShardHeader(fd->get(), path) : Result<ShardInfo>(fd.status());
  struct stat st {};
  if (info.ok() && ::fstat(fd->get(), &st) != 0) info = IoError("stat " + path, errno);
  if (!info.ok()) {
    spdlog::info("version {} of job '{}' rank {}: base version {} cannot be read, writing whole: {}", full.version,
                 full.job, full.rank, base, info.status().message());
    return std::nullopt;
  }
  const ShardMeta& m = info->meta;
  if (info->base || m.job != full.job || m.version != base || m.rank != full.rank || m.world_size != full.world_size) {
    return std::nullopt;
  }
  BaseFile file{base, std::make_shared<const ShardInfo>(std::move(info).value()), static_cast<std::uint64_t>(st.st_dev),
                static_cast<std::uint64_t>(st.st_ino), static_cast<std::uint64_t>(st.st_size),
                st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec};
  MutexLock lock(mu_);
  headers_[key] = file;
  return file;
}

std::optional<DifferentialPlan> BaseChooser::Plan(const ShardInfo& full) {
  if (base_every_ == 0 || full.base) return std::nullopt;
  const ShardMeta& m = full.meta;
  std::deque<std::uint64_t> bases;
  {
    MutexLock lock(mu_);
    auto it = whole_.find({m.job, m.rank});
    if (it != whole_.end()) bases = it->second;
  }
  // The newest base less than N versions old that has committed.
  std::optional<std::uint64_t> base;
  for (auto it = bases.rbegin(); it != bases.rend(); ++it) {
    if (*it >= m.version || m.version - *it >= base_every_) continue;
    if (storage_->Exists(JoinPath(catalog_.VersionDir(m.job, *it), kCommittedMarker))) {
      base = *it;
      break;
    }
  }
  if (!base) return std::nullopt;
  auto header = BaseHeader(m, *base);
  if (!header) return std::nullopt;
  auto plan = PlanDifferential(full, *header->info);
  if (!plan) return std::nullopt;
  // The reference first, then the check that the base is still there (see the header).
  const std::string dir = catalog_.VersionDir(m.job, m.version);
  const std::string base_dir = catalog_.VersionDir(m.job, *base);
  const std::string ref = JoinPath(base_dir, BaseRefName(m.version, catalog_.marker_owner()));
  Status s = storage_->MakeDirs(dir);
  if (s.ok()) s = storage_->WriteFileAtomic(ref, "");
  // Still committed, and its shard still the file whose header the plan compared against.
  if (s.ok() && !storage_->Exists(JoinPath(base_dir, kCommittedMarker))) {
    s = NotFound("base version " + std::to_string(*base) + " was deleted meanwhile");
  }
  if (s.ok() && !SameFile(FileIdentity(catalog_.ShardPath(m.job, *base, m.rank)), header->dev, header->ino,
                          header->size, header->mtime_ns)) {
    s = NotFound("base version " + std::to_string(*base) + "'s shard is not the file read before");
  }
  if (!s.ok()) {
    // The reference stays: it is one per node and version, and another rank of this node may
    // have found the base committed and be writing over it (it keeps the base only while this
    // version's directory exists).
    spdlog::info("version {} of job '{}' rank {}: written whole: {}", m.version, m.job, m.rank, s.message());
    MutexLock lock(mu_);
    std::erase(whole_[{m.job, m.rank}], *base);
    headers_.erase({m.job, m.rank});
    return std::nullopt;
  }
  plan->ref_path = ref;
  return plan;
}

void BaseChooser::PersistedWhole(const ShardMeta& meta) {
  if (base_every_ == 0) return;
  MutexLock lock(mu_);
  auto& bases = whole_[{meta.job, meta.rank}];
  if (!bases.empty() && bases.back() >= meta.version) {
    // A rolled-back or restarted run numbers again: what it wrote before is no base.
    bases.clear();
    headers_.erase({meta.job, meta.rank});
  }
  bases.push_back(meta.version);
  // Too old to be the base of a later version: gone. The others stay, however many, so that
  // the newest committed one is still there when commits lag several versions behind.
  while (!bases.empty() && bases.front() + base_every_ <= meta.version) bases.pop_front();
  while (bases.size() > kBasesKept) bases.pop_front();
}

}  // namespace ckpt
