#include "daemon/metrics/daemon_metrics.h"

#include <algorithm>

namespace ckpt::metrics {
namespace {

constexpr const char* kTierNames[4] = {"memory", "local", "persistent", "peer"};
constexpr const char* kReplicationEventNames[kReplicationEvents] = {"sent", "send_failed", "received", "refused",
                                                                   "peer_fallback", "unproven", "peer_stalled"};
constexpr const char* kReplicationDirections[4] = {"sent", "received", "fetched", "served"};
constexpr const char* kTransferKinds[3] = {"full", "delta", "skipped"};

std::function<std::unique_ptr<Histogram>()> Durations() {
  return [] { return std::make_unique<Histogram>(DurationBuckets()); };
}

}  // namespace

const char* ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kCopy:
      return "copy";
    case ErrorKind::kWrite:
      return "write";
    case ErrorKind::kPromote:
      return "promote";
    case ErrorKind::kCommit:
      return "commit";
    case ErrorKind::kCatalog:
      return "catalog";
    case ErrorKind::kRestore:
      return "restore";
    case ErrorKind::kRestoreVerify:
      return "restore_verify";
  }
  return "unknown";
}

DaemonMetrics::DaemonMetrics()
    : copied_host_(copied_.With({{"source", "host"}})),
      copied_device_(copied_.With({{"source", "device"}})),
      promoted_(promoted_family_.With({{"tier", "persistent"}})),
      flush_family_("ckptd_flush_duration_seconds",
                    "Time from a Snapshot call to its shard's file durable on its first tier (local, or "
                    "persistent without a local tier); copy and write overlap.",
                    Durations()),
      flush_local_(flush_family_.With({{"tier", "local"}})),
      flush_persistent_(flush_family_.With({{"tier", "persistent"}})),
      promote_family_("ckptd_promotion_duration_seconds",
                      "Time to copy one shard from the local tier to the persistent tier.", Durations()),
      promote_seconds_(promote_family_.With({{"tier", "persistent"}})),
      restore_family_("ckptd_restore_duration_seconds",
                      "Time a Restore call took, from waiting for in-flight versions to the last byte in the "
                      "trainer's regions, by the tier read.",
                      Durations()),
      stall_(DurationBuckets()) {
  // Every tier and kind is shown from the start, at 0, so that rate() and alerts see the
  // first increase.
  for (int t = 0; t < 3; ++t) written_[t] = &written_family_.With({{"tier", kTierNames[t]}});
  for (int t = 0; t < 4; ++t) restore_seconds_[t] = &restore_family_.With({{"tier", kTierNames[t]}});
  for (std::size_t e = 0; e < kReplicationEvents; ++e) {
    replication_[e] = &replication_family_.With({{"event", kReplicationEventNames[e]}});
  }
  for (int d = 0; d < 4; ++d) {
    replication_bytes_[d] = &replication_bytes_family_.With({{"direction", kReplicationDirections[d]}});
  }
  for (int k = 0; k < 3; ++k) transfer_bytes_[k] = &transfer_bytes_family_.With({{"kind", kTransferKinds[k]}});
  for (std::size_t k = 0; k < kErrorKinds; ++k) {
    errors_[k] = &errors_family_.With({{"kind", ErrorKindName(static_cast<ErrorKind>(k))}});
  }
}

void DaemonMetrics::Promoted(std::uint64_t bytes, double seconds) {
  promoted_.Add(bytes);
  promote_seconds_.Observe(seconds);
}

void DaemonMetrics::VersionFailed(const std::string& job, std::uint64_t version) {
  {
    MutexLock lock(failed_mu_);
    const auto key = std::make_pair(job, version);
    if (std::find(recent_failed_.begin(), recent_failed_.end(), key) != recent_failed_.end()) return;
    recent_failed_.push_back(key);
    // More versions than this failing at once on one node are not told apart.
    while (recent_failed_.size() > 256) recent_failed_.pop_front();
  }
  failed_.With({{"job", job}}).Add();
}

void DaemonMetrics::Render(Exposition& out, const LabelFilter& filter) const {
  copied_.Render(out, nullptr);
  written_family_.Render(out, nullptr);
  promoted_family_.Render(out, nullptr);
  flush_family_.Render(out, nullptr);
  promote_family_.Render(out, nullptr);
  restore_family_.Render(out, nullptr);
  committed_.Render(out, filter);
  failed_.Render(out, filter);
  aborted_.Render(out, filter);
  under_replicated_.Render(out, filter);
  errors_family_.Render(out, nullptr);
  replication_family_.Render(out, nullptr);
  replication_bytes_family_.Render(out, nullptr);
  transfer_bytes_family_.Render(out, nullptr);
  out.Header(
      "ckptd_snapshot_stall_seconds", "histogram",
      "Time trainers blocked in wait_snapshot, as their clients measured and reported it on their next "
      "Snapshot call.");
  stall_.Render(out, "ckptd_snapshot_stall_seconds", {});
}

DaemonMetrics& Metrics() {
  static DaemonMetrics* const metrics = new DaemonMetrics();  // never destroyed: threads may outlive main
  return *metrics;
}

}  // namespace ckpt::metrics
