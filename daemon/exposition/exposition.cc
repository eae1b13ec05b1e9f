#include "daemon/exposition/exposition.h"

#include <chrono>

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
  GaugeLine(out, "ckptd_memory_tier_used_bytes", "Bytes of shard images the memory tier holds.",
            static_cast<double>(memory.bytes));
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
  return out.Take();
}

}  // namespace ckpt::metrics
