#include "daemon/catalog/version_index_writer.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "common/mutex.h"
#include "common/names.h"
#include "format/shard_format.h"

namespace ckpt {

Result<VersionIndex> VersionIndexWriter::Build(const std::string& job, std::uint64_t version,
                                               std::uint32_t world_size,
                                               const std::vector<std::string>& registrations) {
  if (registrations.size() != world_size) return Internal("index: one registration per rank is needed");
  Mutex mu;
  VersionIndexBuilder builder;
  Status first_error;  // guarded by mu
  std::atomic<std::uint32_t> next{0};
  std::atomic<bool> failed{false};
  auto read_one = [&](std::uint32_t rank) -> Status {
    const std::string path = tree_.ShardPath(job, version, rank);
    auto fd = storage_.OpenForRead(path, /*direct=*/false);
    if (!fd.ok()) return fd.status().With("index: cannot open the shard of rank " + std::to_string(rank));
    auto info = ReadShardHeader(fd->get(), path);
    if (!info.ok()) return info.status().With("index");
    if (info->meta.rank != rank || info->meta.version != version || info->meta.job != job) {
      return DataLoss("index: " + path + " holds job " + QuoteName(info->meta.job) + " version " +
                      std::to_string(info->meta.version) + " rank " + std::to_string(info->meta.rank));
    }
    if (!info->meta.session.empty() && info->meta.session != registrations[rank]) {
      return FailedPrecondition("index: " + path + " was written by registration " + info->meta.session +
                                ", not by rank " + std::to_string(rank) + "'s current one (" +
                                registrations[rank] + ")");
    }
    MutexLock lock(mu);
    return builder.Add(info.value());
  };
  auto worker = [&] {
    for (std::uint32_t r = next++; r < world_size && !failed; r = next++) {
      Status s = read_one(r);
      if (!s.ok()) {
        MutexLock lock(mu);
        if (!failed.exchange(true)) first_error = s;
      }
    }
  };
  const unsigned threads = std::min<unsigned>(readers_, (world_size + 7) / 8);
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (failed) return first_error;
  auto index = std::move(builder).Finish();
  if (!index.ok())
    return index.status().With("job " + job + " version " + std::to_string(version) + ": index");
  return index;
}

Status VersionIndexWriter::Write(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                 const std::vector<std::string>& registrations) {
  auto index = Build(job, version, world_size, registrations);
  if (!index.ok()) return index.status();
  return storage_.WriteFileAtomic(tree_.IndexFile(job, version), index->Render());
}

}  // namespace ckpt
