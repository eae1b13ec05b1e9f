#include "daemon/exposition/exposition.h"

#include <chrono>
#include <map>

#include "daemon/metrics/daemon_metrics.h"

namespace ckpt::metrics {
namespace {

void GaugeLine(Exposition& out, const std::string& name, const std::string& help, double value,
               const Labels& labels = {}) {
  out.Header(name, "gauge", help);
  out.Sample(name, labels, value);
}

// The process's start on the wall clock, taken once (the daemon's start is on the steady
// clock, which has no epoch).
double StartTimeSeconds(const Daemon& daemon) {
  static const double start = [&] {
    const auto age = std::chrono::steady_clock::now() - daemon.started();
    return std::chrono::duration<double>((std::chrono::system_clock::now() - age).time_since_epoch()).count();
  }();
  return start;
}

}  // namespace

std::string RenderMetrics(Daemon& daemon, const LabelFilter& filter) {
  Exposition out;
  GaugeLine(out, "ckptd_build_info", "Always 1; the labels say which ckptd this is.", 1,
            {{"version", CKPTD_VERSION}});
  GaugeLine(out, "ckptd_start_time_seconds", "When the daemon started, in seconds since the Unix epoch.",
            StartTimeSeconds(daemon));

  Metrics().Render(out, filter);

  const RestoreCounters& restored = daemon.restore_counters();
  out.Header("ckptd_bytes_restored_total", "counter",
             "Bytes of tensor data restored into trainer memory, by the tier they came from.");
  out.Sample("ckptd_bytes_restored_total", {{"tier", "memory"}}, restored.from_memory.load());
  out.Sample("ckptd_bytes_restored_total", {{"tier", "local"}}, restored.from_local.load());
  out.Sample("ckptd_bytes_restored_total", {{"tier", "persistent"}}, restored.from_persistent.load());
  out.Sample("ckptd_bytes_restored_total", {{"tier", "peer"}}, restored.from_peer.load());
  out.Header("ckptd_restores_resharded_total", "counter",
             "Restores at another world size or decomposition, each item filled from the chunks of its global "
             "tensor.");
  out.Sample("ckptd_restores_resharded_total", {}, restored.resharded.load());
  out.Header("ckptd_restores_uncommitted_total", "counter",
             "Restores of a version not committed yet, whose every rank's shard was replicated to peers' memory.");
  out.Sample("ckptd_restores_uncommitted_total", {}, restored.uncommitted.load());
  out.Header("ckptd_bytes_read_total", "counter", "Bytes read from shard files by restores and prefetches.");
  out.Sample("ckptd_bytes_read_total", {}, restored.bytes_read.load());

  const HostPool& pool = daemon.pool();
  GaugeLine(out, "ckptd_pool_capacity_bytes", "Size of the host pool, allocated at start.",
            static_cast<double>(pool.pool_bytes()));
  GaugeLine(out, "ckptd_pool_used_bytes", "Bytes of the host pool held by data in flight.",
            static_cast<double>(pool.used_bytes()));

  const MemoryTier::Stats memory = daemon.tiers().memory().GetStats();
  const MemoryTier::Usage usage = daemon.tiers().memory().GetUsage();
  GaugeLine(out, "ckptd_memory_tier_used_bytes",
            "Bytes of the memory tier's budget in use: held + in flight + kept for reuse.",
            static_cast<double>(usage.accounted));
  GaugeLine(
      out, "ckptd_memory_tier_in_flight_bytes",
      "Bytes of memory tier images still being written, or dropped while a restore or promotion reads them.",
      static_cast<double>(usage.in_flight));
  GaugeLine(out, "ckptd_memory_tier_reusable_bytes",
            "Bytes of freed memory tier buffers kept for reuse (no shard's bytes).",
            static_cast<double>(usage.reusable));
  // Per tier and job: what each job holds (memory: complete images, own and replicas; local:
  // shard files). Only the jobs the reader may see.
  out.Header("ckptd_tier_held_bytes", "gauge", "Bytes of shards a tier holds, by tier and job.");
  auto held = [&](const char* tier, const std::string& job, std::uint64_t bytes) {
    const Labels labels{{"tier", tier}, {"job", job}};
    if (!filter || filter(labels)) out.Sample("ckptd_tier_held_bytes", labels, bytes);
  };
  for (const auto& [job, u] : usage.jobs) held("memory", job, u.bytes + u.replica_bytes);
  std::map<std::string, LocalTier::JobUsage> local;
  if (const LocalTier* tier = daemon.tiers().local()) local = tier->Usage();
  for (const auto& [job, u] : local) held("local", job, u.bytes);
  out.Header("ckptd_tier_held_shards", "gauge", "Shards a tier holds, by tier and job.");
  auto shards = [&](const char* tier, const std::string& job, std::uint64_t n) {
    const Labels labels{{"tier", tier}, {"job", job}};
    if (!filter || filter(labels)) out.Sample("ckptd_tier_held_shards", labels, n);
  };
  for (const auto& [job, u] : usage.jobs) shards("memory", job, u.shards + u.replica_shards);
  for (const auto& [job, u] : local) shards("local", job, u.shards);
  GaugeLine(out, "ckptd_memory_tier_budget_bytes", "The memory tier's budget (0: no memory tier).",
            static_cast<double>(memory.budget));
  GaugeLine(out, "ckptd_memory_tier_shards", "Shard images the memory tier holds.",
            static_cast<double>(memory.images));

  GaugeLine(out, "ckptd_sessions_open", "Trainer sessions (registrations) open.",
            static_cast<double>(daemon.sessions().All().size()));
  GaugeLine(out, "ckptd_promotions_pending",
            "Shards queued or being promoted from the local to the persistent tier.",
            daemon.promoter() ? static_cast<double>(daemon.promoter()->pending()) : 0.0);
  if (WarmStart* warm = daemon.warm_start()) warm->RenderMetrics(out);
  if (ErasureGroup* erasure = daemon.erasure()) {
    const ErasureGroup::Counters c = erasure->counters();
    GaugeLine(out, "ckptd_erasure_parity_bytes",
              "Bytes of erasure-coding parity this daemon holds for its group's other daemons.",
              static_cast<double>(erasure->parity_bytes()));
    GaugeLine(out, "ckptd_erasure_pending_shards",
              "Shards of this daemon whose chunks wait to be sent to their parity holders, the one being sent "
              "included.",
              static_cast<double>(c.pending));
    out.Header("ckptd_erasure_events_total", "counter",
               "Erasure coding, by event: chunks sent to a parity holder and sends that failed, shards rebuilt "
               "from the group and rebuilds that failed, parity rows or chunks found corrupt by their checksums.");
    out.Sample("ckptd_erasure_events_total", {{"event", "chunk_sent"}}, c.chunks_sent);
    out.Sample("ckptd_erasure_events_total", {{"event", "send_failed"}}, c.send_failures);
    out.Sample("ckptd_erasure_events_total", {{"event", "rebuilt"}}, c.rebuilds);
    out.Sample("ckptd_erasure_events_total", {{"event", "rebuild_failed"}}, c.rebuild_failures);
    out.Sample("ckptd_erasure_events_total", {{"event", "corrupt"}}, c.corrupt_fragments);
  }
  return out.Take();
}

}  // namespace ckpt::metrics
