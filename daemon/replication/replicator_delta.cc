// Replicator, deltas: which version a peer holds of each rank, and sending the next one as
// a delta on it (replicator.h, "Deltas"; DESIGN-NOTES.md, "Differential replicas").
#include <spdlog/spdlog.h>

#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replication/peer_protocol.h"
#include "daemon/replication/replicator.h"

namespace ckpt {

DeltaPlan Replicator::DeltaBaseFor(const std::string& peer, const ShardMeta& meta,
                                   const std::vector<ItemSpan>& items, std::uint64_t header_end) {
  DeltaPlan plan;
  if (!deltas_ || items.empty()) return plan;
  MutexLock lock(mu_);
  auto it = delta_bases_.find({peer, meta.job, meta.rank});
  if (it == delta_bases_.end()) return plan;
  const DeltaBase& base = it->second;
  if (base.version >= meta.version || base.session != meta.session) return plan;
  plan.ranges = DeltaRanges(header_end, items, base.items);
  if (!plan.ranges.empty()) plan.base_version = base.version;
  return plan;
}

void Replicator::NoteDeltaBase(const std::string& peer, const ShardMeta& meta, std::vector<ItemSpan> items) {
  MutexLock lock(mu_);
  auto& base = delta_bases_[{peer, meta.job, meta.rank}];
  if (base.version > meta.version) return;  // a newer one is the peer's base already
  base = DeltaBase{meta.version, meta.session, std::move(items)};
}

void Replicator::ForgetDeltaBases(const std::string& peer, const std::string& job, std::uint32_t rank) {
  MutexLock lock(mu_);
  for (auto it = delta_bases_.begin(); it != delta_bases_.end();) {
    const auto& [p, j, r] = it->first;
    const bool match = (peer.empty() || p == peer) && j == job && (rank == kAllRanks || r == rank);
    it = match ? delta_bases_.erase(it) : std::next(it);
  }
}

Status Replicator::SendShard(const std::string& peer, const std::shared_ptr<MemoryImage>& image,
                             const std::vector<ItemSpan>& items, std::uint64_t header_end,
                             std::uint64_t* held) {
  const ShardMeta& m = image->meta;
  DeltaPlan plan = DeltaBaseFor(peer, m, items, header_end);
  Status st = SendTo(peer, image, held, plan);
  if (!st.ok() && plan.base_version != 0 &&
      (st.code() == StatusCode::kFailedPrecondition || st.code() == StatusCode::kDataLoss)) {
    // The peer no longer holds the base (its budget or retention dropped it, or it restarted),
    // has no room beside it, holds it other than this daemon remembers, or does not know
    // deltas (a daemon of an older release): the whole image, once, on a new stream.
    spdlog::info("replication: {} refused {} as a delta on version {} ({}): sending the whole image", peer,
                 DescribeShard(m.job, m.version, m.rank), plan.base_version, st.message());
    ForgetDeltaBases(peer, m.job, m.rank);
    plan = DeltaPlan{};
    st = SendTo(peer, image, held, plan);
  }
  if (!st.ok()) {
    ForgetDeltaBases(peer, m.job, m.rank);
    return st;
  }
  if (plan.base_version == 0) {
    metrics::Metrics().TransferBytesAdd(metrics::TransferBytes::kFull, image->file_bytes);
    spdlog::info("replicated version {} of job {} rank {} to {} whole: {} of {} bytes sent", m.version, m.job,
                 m.rank, peer, image->file_bytes, image->file_bytes);
  } else {
    const std::uint64_t sent = plan.bytes();
    metrics::Metrics().TransferBytesAdd(metrics::TransferBytes::kDelta, sent);
    metrics::Metrics().TransferBytesAdd(metrics::TransferBytes::kSkipped, image->file_bytes - sent);
    spdlog::info(
        "replicated version {} of job {} rank {} to {} as a delta on version {}: {} of {} bytes sent",
        m.version, m.job, m.rank, peer, plan.base_version, sent, image->file_bytes);
  }
  if (deltas_ && !items.empty()) NoteDeltaBase(peer, m, items);
  return st;
}

}  // namespace ckpt
