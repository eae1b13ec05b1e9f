// LocalTier: the node-local directory (--local: NVMe, /dev/shm) that shards are written to
// first when it is configured. In: published shards (by the flush engine), prefetched ones
// (from the persistent tier). Out: shards for promotion to the persistent tier (Promoter),
// and for restores, which read here before the persistent tier.
//
// It has the persistent tier's tree of version directories (format/paths.h) but no markers
// of its own: a version here is committed when the persistent tier says so. Retention keeps
// the newest `keep` committed versions of each job, drops uncommitted versions older than a
// committed one (promoted already: their commit needs only the persistent tier), and never touches a pinned
// version (a promotion queued, a restore or prefetch reading it). After a restart, ScanUncommitted() finds
// the shards of versions not committed, to promote or to watch. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "daemon/base/config.h"
#include "daemon/io/storage.h"
#include "format/paths.h"
#include "format/shard_format.h"

namespace ckpt {

class LocalTier {
 public:
  // Opens the tier at `root` (created if missing): removes *.tmp leftovers and probes
  // O_DIRECT (`mode` kOn fails where it is refused). `catalog` is the persistent tier's.
  static Result<std::unique_ptr<LocalTier>> Open(std::shared_ptr<Storage> storage, const std::string& root,
                                                 DirectIoMode mode, std::uint32_t keep, Catalog& catalog);

  const std::string& root() const { return tree_.root(); }
  bool direct_io() const { return direct_io_; }
  std::uint32_t keep() const { return keep_; }
  std::string VersionDir(const std::string& job, std::uint64_t version) const {
    return tree_.VersionDir(job, version);
  }
  std::string ShardPath(const std::string& job, std::uint64_t version, std::uint32_t rank) const {
    return tree_.ShardPath(job, version, rank);
  }
  bool Has(const std::string& job, std::uint64_t version, std::uint32_t rank) const {
    return storage_->Exists(ShardPath(job, version, rank));
  }

  // Retention skips a pinned version; pins nest.
  void Pin(const std::string& job, std::uint64_t version) EXCLUDES(pins_mu_);
  void Unpin(const std::string& job, std::uint64_t version) EXCLUDES(pins_mu_);

  // Deletes what the retention rule no longer keeps of `job`, or of every job.
  void ApplyRetention(const std::string& job) EXCLUDES(retention_mu_, pins_mu_);
  void ApplyRetentionToAll();

  // The ranks with a shard here, per version of `job`.
  std::map<std::uint64_t, std::vector<std::uint32_t>> List(const std::string& job) const;
  // Shard files here and their bytes, per job (a listing of the tree and a size per file;
  // a file that goes meanwhile is not counted).
  struct JobUsage {
    std::uint64_t shards = 0, bytes = 0;
  };
  std::map<std::string, JobUsage> Usage() const;

  // A shard of a version not committed (yet).
  struct Uncommitted {
    ShardMeta meta;
    std::string path;
    std::uint64_t file_bytes = 0;
  };
  // Every such shard, job by job (invalid files are removed with a warning). The caller
  // queues (and so pins) what it resumes, then applies retention (ApplyRetentionToAll).
  Result<std::vector<Uncommitted>> ScanUncommitted();

 private:
  LocalTier(std::shared_ptr<Storage> storage, const std::string& root, bool direct_io, std::uint32_t keep,
            Catalog& catalog)
      : storage_(std::move(storage)), tree_(root), direct_io_(direct_io), keep_(keep), catalog_(catalog) {}
  bool Pinned(const std::string& job, std::uint64_t version) const EXCLUDES(pins_mu_);
  void RemoveVersion(const std::string& job, std::uint64_t version);

  const std::shared_ptr<Storage> storage_;
  const CheckpointTree tree_;
  const bool direct_io_;
  const std::uint32_t keep_;
  Catalog& catalog_;
  mutable Mutex pins_mu_;
  std::multiset<std::pair<std::string, std::uint64_t>> pins_ GUARDED_BY(pins_mu_);
  Mutex retention_mu_;  // one retention pass at a time
};

}  // namespace ckpt
