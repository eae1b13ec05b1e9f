// DaemonMetrics: the figures ckptd counts as it works, one set per process (Metrics()),
// updated where the work happens:
//
//   copy (SnapshotEngine)    bytes copied out of trainer memory, by source
//   write (FlushEngine)      bytes written, by tier (memory: the memory tier's image);
//                            time from Snapshot call to the shard's file durable
//   promote (Promoter)       bytes promoted to the persistent tier, and how long it took
//   commit / fail (Daemon)   versions committed and failed, by job; errors by kind
//   restore (Restorer)       restore durations, by tier; restore errors
//   snapshot call (rpc)      the stall the client measured in its last wait_snapshot
//
// What the daemon already keeps for its Status report (pool, tiers, sessions, pending
// promotions, restored bytes) is read from there when rendering (RenderMetrics in
// daemon/exposition/exposition.h), not counted twice. Data-path updates are relaxed atomic
// adds on series looked up once, here. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "common/mutex.h"
#include "daemon/metrics/registry.h"

namespace ckpt::metrics {

// Why background work or a restore failed (the `kind` label of ckptd_errors_total).
enum class ErrorKind {
  kCopy,           // copying a shard out of trainer memory
  kWrite,          // writing a shard to its first tier
  kPromote,        // copying a shard from the local to the persistent tier
  kCommit,         // writing or reading commit markers
  kCatalog,        // the persistent tier's tree (retention, latest, leftovers)
  kRestore,        // a restore that returned an error
  kRestoreVerify,  // a tier's copy that failed verification on restore (the next tier was read)
};
inline constexpr std::size_t kErrorKinds = 7;
const char* ErrorKindName(ErrorKind kind);

// Tiers as label values; kMemory is the memory tier's image of a shard; kPeer (restores
// only) a replica in a peer daemon's memory.
enum class TierLabel { kMemory, kLocal, kPersistent, kPeer };

// Peer replication: what happened to shards sent to or asked of peers (the
// `event` label of ckptd_replication_events_total).
enum class ReplicationEvent {
  kSent,           // a shard image a peer acknowledged holding
  kSendFailed,     // a peer refused a shard or could not be reached (the next one is tried)
  kReceived,       // a replica this daemon keeps
  kRefused,        // a replica refused here (no room, a checksum, an unauthenticated call)
  kPeerFallback,   // a restore that went on to the next replica or tier (missing, failed)
  kUnproven,       // a peer's answer or shard without proof that it knows --peer-secret: ignored
  kPeerStalled,    // a peer's transfer that made no progress for --peer-progress-timeout-s: given up
};
inline constexpr std::size_t kReplicationEvents = 7;
// Bytes by direction (the `direction` label of ckptd_replication_bytes_total).
enum class ReplicationBytes { kSent, kReceived, kFetched, kServed };
// Replica bytes by how a transfer sent them (the `kind` label of
// ckptd_replication_transfer_bytes_total): in whole images, in deltas, and not sent because
// the peer's replica of the delta's base held them.
enum class TransferBytes { kFull, kDelta, kSkipped };

class DaemonMetrics {
 public:
  DaemonMetrics();

  // Data path: one relaxed add each.
  void Copied(bool from_device, std::uint64_t n) { (from_device ? copied_device_ : copied_host_).Add(n); }
  void Written(TierLabel tier, std::uint64_t n) { written_[static_cast<int>(tier)]->Add(n); }

  // Per shard / version / call.
  // `tier`: the shard's first file, local or persistent.
  void Flushed(TierLabel tier, double seconds) {
    (tier == TierLabel::kLocal ? flush_local_ : flush_persistent_).Observe(seconds);
  }
  void Promoted(std::uint64_t bytes, double seconds);
  void Restored(TierLabel tier, double seconds) {
    restore_seconds_[static_cast<int>(tier)]->Observe(seconds);
  }
  void Committed(const std::string& job) { committed_.With({{"job", job}}).Add(); }
  void ShardAborted(const std::string& job) { aborted_.With({{"job", job}}).Add(); }
  // A version this daemon committed without every rank's shard replicated; `reason`:
  // "timeout", "superseded" or "shutdown".
  void UnderReplicated(const std::string& job, const std::string& reason) {
    under_replicated_.With({{"job", job}, {"reason", reason}}).Add();
  }
  // Counts a version once, however many of its shards fail.
  void VersionFailed(const std::string& job, std::uint64_t version) EXCLUDES(failed_mu_);
  void Error(ErrorKind kind) { errors_[static_cast<std::size_t>(kind)]->Add(); }
  void SnapshotStall(double seconds) { stall_.Observe(seconds); }
  void Replication(ReplicationEvent e) { replication_[static_cast<std::size_t>(e)]->Add(); }
  void ReplicationBytesAdd(ReplicationBytes d, std::uint64_t n) { replication_bytes_[static_cast<int>(d)]->Add(n); }
  void TransferBytesAdd(TransferBytes k, std::uint64_t n) { transfer_bytes_[static_cast<int>(k)]->Add(n); }

  // Appends every metric above to `out`; series with a job label only where `filter`
  // allows (null: all).
  void Render(Exposition& out, const LabelFilter& filter) const;

 private:
  Family<Counter> copied_{"ckptd_bytes_copied_total",
                          "Bytes copied out of trainer memory into the host pool, by source (host or device "
                          "memory)."};
  Counter& copied_host_;
  Counter& copied_device_;
  Family<Counter> written_family_{
      "ckptd_bytes_written_total",
      "Bytes of shard data written to a tier (memory: into the memory tier's copy)."};
  std::array<Counter*, 3> written_{};
  Family<Counter> promoted_family_{
      "ckptd_bytes_promoted_total",
      "Bytes of shard files promoted from the local tier to the persistent tier."};
  Counter& promoted_;
  Family<Histogram> flush_family_;
  Histogram& flush_local_;
  Histogram& flush_persistent_;
  Family<Histogram> promote_family_;
  Histogram& promote_seconds_;
  Family<Histogram> restore_family_;
  std::array<Histogram*, 4> restore_seconds_{};
  Family<Counter> committed_{"ckptd_versions_committed_total",
                             "Versions whose commit this daemon wrote or saw, by job."};
  Family<Counter> failed_{"ckptd_versions_failed_total",
                          "Versions of which a shard served by this daemon failed, by job."};
  Family<Counter> aborted_{"ckptd_versions_aborted_total",
                           "Shards served by this daemon that were aborted (a torn snapshot: memory changed "
                           "during the copy, or never sealed), by job; such a version never commits."};
  Family<Counter> under_replicated_{
      "ckptd_versions_under_replicated_total",
      "Versions this daemon committed without every rank's shard held by --replicas peers, by job and reason "
      "(timeout: --replica-commit-timeout-s ran out; superseded: a newer version had committed first; "
      "shutdown: "
      "the daemon stopped replicating as it stopped)."};
  Family<Counter> errors_family_{
      "ckptd_errors_total", "Errors of background work and restores, by kind (see docs/ops/metrics.md)."};
  std::array<Counter*, kErrorKinds> errors_{};
  Histogram stall_;
  Family<Counter> replication_family_{
      "ckptd_replication_events_total",
      "Peer replication (--replicas): shards sent and acknowledged, sends failed, replicas received and "
      "refused, restores that fell back to the next replica or tier."};
  std::array<Counter*, kReplicationEvents> replication_{};
  Family<Counter> replication_bytes_family_{
      "ckptd_replication_bytes_total",
      "Bytes of shard images sent to peers, received from them, fetched from them by restores, and served "
      "to their restores."};
  std::array<Counter*, 4> replication_bytes_{};
  Family<Counter> transfer_bytes_family_{
      "ckptd_replication_transfer_bytes_total",
      "Bytes of shard images replicated to peers: sent in whole images (kind=full), sent in deltas on a "
      "version the peer holds (kind=delta), and not sent because the peer's replica of that version held "
      "them (kind=skipped). Counted once the peer acknowledged the transfer."};
  std::array<Counter*, 3> transfer_bytes_{};

  // The versions counted as failed lately, so that the other shards of one do not count it
  // again (failures are rare: a lock is fine here).
  mutable Mutex failed_mu_;
  std::deque<std::pair<std::string, std::uint64_t>> recent_failed_ GUARDED_BY(failed_mu_);
};

// The process's metrics.
DaemonMetrics& Metrics();

}  // namespace ckpt::metrics
