// Catalog: the daemon's view of the checkpoint tree on storage, and the commit stage.
//
// In: durable shards (from the flush engine). Out: COMMITTED markers and `latest`, written
// once every rank 0..world_size-1 of a version has a durable shard in the version's
// directory. Readers trust only committed versions. At start, Recover() removes *.tmp
// leftovers and rewrites any `latest` that does not name the newest committed version.
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/storage.h"

namespace ckpt {

struct VersionEntry {
  std::uint64_t version = 0;
  bool committed = false;
  std::vector<std::uint32_t> ranks;  // ranks with a durable shard
};

class Catalog {
 public:
  // `keep_last` > 0: after each commit, delete committed versions older than the newest
  // `keep_last` ones.
  Catalog(std::shared_ptr<Storage> storage, std::string root, std::uint32_t keep_last = 0);

  const std::string& root() const { return root_; }
  std::string JobDir(const std::string& job) const;
  std::string VersionDir(const std::string& job, std::uint64_t version) const;
  std::string ShardPath(const std::string& job, std::uint64_t version, std::uint32_t rank) const;

  // Scans every job under the root: removes temporary files, repairs `latest`.
  Status Recover();
  // Creates the version's directory (and the job's), durably.
  Status PrepareVersionDir(const std::string& job, std::uint64_t version);
  // Commits the version if every rank has a durable shard; sets *committed accordingly.
  Status CommitIfComplete(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                          bool* committed);
  // Newest committed version of the job, 0 if none.
  std::uint64_t Latest(const std::string& job);
  bool IsCommitted(const std::string& job, std::uint64_t version);
  // Versions of the job on storage, oldest first.
  Result<std::vector<VersionEntry>> List(const std::string& job);
  // Rollback: moves committed versions newer than `version` under JOB/set-aside/ and
  // points `latest` at `version`. Returns how many were set aside.
  Result<int> SetAsideNewerThan(const std::string& job, std::uint64_t version);
  // While a version is pinned (a restore reads it), retention does not delete it.
  void Pin(const std::string& job, std::uint64_t version);
  void Unpin(const std::string& job, std::uint64_t version);

 private:
  Status RecoverJob(const std::string& job);
  std::uint64_t ScanLatest(const std::string& job);
  Status WriteLatest(const std::string& job, std::uint64_t version);
  Status ApplyRetention(const std::string& job);

  std::shared_ptr<Storage> storage_;
  std::string root_;
  std::uint32_t keep_last_;
  // Commits and rollbacks do I/O (fdatasync, fsync) and are serialised by commit_mu_;
  // latest_mu_ guards only the cache, so Snapshot calls asking Latest() never wait for a
  // commit's disk flushes.
  std::mutex commit_mu_;
  std::mutex latest_mu_;
  std::map<std::string, std::uint64_t> latest_;  // cache; loaded from storage on first use
  std::multiset<std::pair<std::string, std::uint64_t>> pinned_;  // guarded by commit_mu_
};

}  // namespace ckpt
