// SnapshotAdmission: turns a Snapshot call into a shard queued for copying, or a clear
// refusal. In order: a failure of an earlier version not yet reported to the trainer is
// reported now (and this snapshot is not taken); the version is checked (in range, above
// the registration's last one and the job's newest commit); the trainer's table is checked
// to be the generation it validated (re-read if it changed); blobs are checked (names, no
// clash with tensors, the --max-blob-mib budget). Backpressure: while kMaxInFlight versions
// of the registration are neither durable nor failed, the call waits, so a trainer that
// outruns its storage stalls rather than growing the daemon's memory. The shard then goes
// to the first tier (local if configured, else persistent) through the snapshot engine.
// Thread-safe; the caller holds the session's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/cancellable_wait.h"
#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/pipeline/snapshot_engine.h"
#include "daemon/session/session.h"
#include "daemon/session/table_loader.h"
#include "daemon/tiers/local_tier.h"

namespace ckpt {

struct SnapshotBlob {
  std::string name;
  std::shared_ptr<const std::string> data;
  std::optional<std::uint32_t> for_rank;  // only this rank gets it at a restore by another world size
};

struct SnapshotRequestData {
  std::uint64_t version = 0;
  std::uint64_t table_generation = 0;  // the generation the client validated
  std::uint32_t trainer_event_slot = 0;
  std::vector<SnapshotBlob> blobs;
};

class SnapshotAdmission {
 public:
  // Versions have at most 18 digits, so version directory names always parse back.
  static constexpr std::uint64_t kMaxVersion = 999'999'999'999'999'999ull;
  // Versions of one registration that may be in flight (not yet durable or failed) at once.
  static constexpr std::size_t kMaxInFlight = 32;
  // Versions of one registration kept for Wait calls once they are durable or failed.
  static constexpr std::size_t kVersionsKept = 16;

  // `local` may be null (no local tier: shards go to the persistent tier).
  SnapshotAdmission(Catalog& catalog, bool persistent_direct_io, LocalTier* local, TableLoader& loader,
                    ShardRegistry& shards, SnapshotEngine& engine, std::uint64_t max_blob_bytes)
      : catalog_(catalog),
        persistent_direct_io_(persistent_direct_io),
        local_(local),
        loader_(loader),
        shards_(shards),
        engine_(engine),
        max_blob_bytes_(max_blob_bytes) {}

  // Admits and queues the snapshot; returns its shard.
  Result<std::shared_ptr<ShardJob>> Admit(Session& s, const SnapshotRequestData& req,
                                          const CancelCheck& cancelled) REQUIRES(s.mu);

 private:
  Status ReportEarlierFailure(Session& s, std::uint64_t version) REQUIRES(s.mu);
  Status WaitForRoom(Session& s, const CancelCheck& cancelled) REQUIRES(s.mu);
  Status CheckVersion(Session& s, std::uint64_t version) REQUIRES(s.mu);
  // Sealed registrations: the newest version is sealed, aborted or failed.
  Status CheckSealed(Session& s, std::uint64_t version) REQUIRES(s.mu);
  Status CheckTable(Session& s, std::uint64_t validated_generation) REQUIRES(s.mu);

  Catalog& catalog_;
  const bool persistent_direct_io_;
  LocalTier* const local_;
  TableLoader& loader_;
  ShardRegistry& shards_;
  SnapshotEngine& engine_;
  const std::uint64_t max_blob_bytes_;
};

}  // namespace ckpt
