#include "tools/ckptctl/status_view.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <vector>

#include "tools/ckptctl/common.h"
#include "tools/ckptctl/json.h"

namespace ckptctl {
namespace {

std::string Format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

std::string Rate(double bytes_per_s) {
  return Human(static_cast<std::uint64_t>(std::max(0.0, bytes_per_s))) + "/s";
}

int Percent(std::uint64_t part, std::uint64_t total) {
  return total == 0 ? 100 : static_cast<int>(std::min<std::uint64_t>(100, part * 100 / total));
}

// "12 s ago", from a time in milliseconds since the Unix epoch.
std::string Ago(std::int64_t unix_ms) {
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  return std::to_string(std::max<std::int64_t>(0, now - unix_ms) / 1000) + " s ago";
}

// "0-3,6": ranks in increasing order, runs joined.
std::string Ranks(const auto& ranks) {
  std::vector<std::uint32_t> sorted(ranks.begin(), ranks.end());
  std::sort(sorted.begin(), sorted.end());
  std::string out;
  for (std::size_t i = 0; i < sorted.size();) {
    std::size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(sorted[i]);
    if (j > i) out += "-" + std::to_string(sorted[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

std::optional<Throughput> ThroughputBetween(const ckpt::v1::StatusReply& before,
                                            const ckpt::v1::StatusReply& after, double interval_s) {
  if (interval_s <= 0 || before.daemon_instance() != after.daemon_instance()) return std::nullopt;
  auto delta = [](std::uint64_t a, std::uint64_t b) { return b >= a ? static_cast<double>(b - a) : 0.0; };
  Throughput t;
  t.interval_s = interval_s;
  t.copy_bytes_per_s = delta(before.bytes_copied_total(), after.bytes_copied_total()) / interval_s;
  t.write_bytes_per_s = delta(before.bytes_written_total(), after.bytes_written_total()) / interval_s;
  return t;
}

bool InFlight(const ckpt::v1::ShardStatus& shard) {
  return (shard.state() == ckpt::v1::SHARD_STATE_IN_PROGRESS ||
          shard.state() == ckpt::v1::SHARD_STATE_UNSEALED) &&
         (shard.level() == ckpt::v1::LEVEL_UNSPECIFIED || shard.level() == ckpt::v1::LEVEL_CAPTURED ||
          shard.level() == ckpt::v1::LEVEL_LOCAL);
}

std::string ShardNote(const ckpt::v1::ShardStatus& shard) {
  if (shard.error().empty()) return "";
  if (shard.state() == ckpt::v1::SHARD_STATE_SKIPPED && shard.superseded_by() > 0)
    return Format("  by v%" PRIu64 ": ", shard.superseded_by()) + shard.error();
  return "  " + shard.error();
}

bool AnyShardFailed(const ckpt::v1::StatusReply& r) {
  for (const auto& sh : r.shards()) {
    if (sh.state() == ckpt::v1::SHARD_STATE_FAILED) return true;
  }
  return false;
}

std::string TierLines(const ckpt::v1::StatusReply& r) {
  std::string out;
  auto jobs = [&](const ckpt::v1::TierStatus& t) {
    for (const auto& j : t.jobs()) {
      out += Format("    job %-16s %" PRIu64 " shard(s) %s",
                    j.job().empty() ? "(other jobs)" : j.job().c_str(), j.shards(), Human(j.bytes()).c_str());
      if (j.replica_shards() > 0)
        out += Format("; replicas from peers %" PRIu64 " shard(s) %s", j.replica_shards(),
                      Human(j.replica_bytes()).c_str());
      out += "\n";
    }
  };
  for (const auto& t : r.tiers()) {
    if (t.name() == "memory") {
      out += Format("  %-10s held %s; in flight %s; kept for reuse %s; budget %s used of %s; keeps %s\n",
                    t.name().c_str(), Human(t.held_bytes()).c_str(), Human(t.in_flight_bytes()).c_str(),
                    Human(t.reusable_bytes()).c_str(), Human(t.bytes()).c_str(),
                    Human(t.budget_bytes()).c_str(), t.retention().c_str());
      jobs(t);
    } else if (t.name() == "local") {
      out += Format("  %-10s %s; held %s; keeps %s\n", t.name().c_str(), t.dir().c_str(),
                    Human(t.held_bytes()).c_str(), t.retention().c_str());
      jobs(t);
    } else {
      out += Format("  %-10s %s; keeps %s (bytes per job: ckptctl jobs)\n", t.name().c_str(), t.dir().c_str(),
                    t.retention().c_str());
    }
  }
  out += Format(
      "  in flight  %u shard(s), %s not yet persisted; %s of it in the host pool; %u promotion(s) pending\n",
      r.in_flight_shards(), Human(r.in_flight_bytes()).c_str(), Human(r.pool_used_bytes()).c_str(),
      r.promotions_pending());
  return out;
}

std::string TierSummary(const ckpt::v1::StatusReply& r) {
  std::string out;
  for (const auto& t : r.tiers()) {
    if (t.name() == "memory") {
      out += Format(" memory held %s, in flight %s, reusable %s, of %s;", Human(t.held_bytes()).c_str(),
                    Human(t.in_flight_bytes()).c_str(), Human(t.reusable_bytes()).c_str(),
                    Human(t.budget_bytes()).c_str());
    } else if (t.name() == "local") {
      out += Format(" local %s held;", Human(t.held_bytes()).c_str());
    } else {
      out += Format(" %s %s;", t.name().c_str(), t.dir().c_str());
    }
  }
  return out + Format(" %u promotion(s) pending", r.promotions_pending());
}

std::string ErasureLines(const ckpt::v1::StatusReply& r) {
  if (r.erasure().empty()) return "";
  return Format("\nerasure coding: %s; holds %s of parity for the group; %" PRIu64 " chunk(s) sent, %" PRIu64
                " failed; %" PRIu64 " shard(s) rebuilt from the group, %" PRIu64 " rebuild(s) failed, %" PRIu64
                " corrupt parity row(s) or chunk(s) found\n",
                r.erasure().c_str(), Human(r.erasure_parity_bytes()).c_str(), r.erasure_chunks_sent(),
                r.erasure_send_failures(), r.erasure_rebuilds(), r.erasure_rebuild_failures(),
                r.erasure_corrupt_fragments());
}

std::string ReplicationLines(const ckpt::v1::StatusReply& r) {
  if (r.replicas() == 0) return ErasureLines(r);
  std::string out = ErasureLines(r) + Format(
      "\nreplication: %u replica(s) per shard, this daemon %s; %" PRIu64 " shard(s) replicated, %" PRIu64
      " failed; %s restored from peers; %" PRIu64 " restore(s) of a version not committed yet\n",
      r.replicas(), r.peer_address().c_str(), r.replicated_shards(), r.replication_failures(),
      Human(r.restored_bytes_peer()).c_str(), r.restores_uncommitted());
  for (const auto& p : r.peers()) {
    const std::string sent = p.sent_bytes_held_unix_ms() == 0
                                 ? std::string(
                                       "holds ? of this daemon's shards (it has not said since this daemon "
                                       "started)")
                                 : "holds " + Human(p.sent_bytes_held()) +
                                       " of this daemon's shards (as it said " +
                                       Ago(p.sent_bytes_held_unix_ms()) + ")";
    out += Format("  peer %-22s %-7s ", p.address().c_str(), p.holder() ? "holder" : "") + sent + "; " +
           Human(p.held_bytes()) + " of its replicas held here" +
           (p.error().empty() ? std::string() : "; last error: " + p.error()) + "\n";
  }
  for (const auto& j : r.job_replication()) {
    if (j.version() == 0) continue;
    std::vector<std::uint32_t> ranks;
    for (const auto& rk : j.ranks()) ranks.push_back(rk.rank());
    if (ranks.empty()) {
      out += Format("  job %-16s v%-8" PRIu64
                    " replication of its ranks here unknown (none sent since this daemon "
                    "started; `ckptctl ls` asks the peers)\n",
                    j.job().c_str(), j.version());
      continue;
    }
    out += Format("  job %-16s v%-8" PRIu64 " %s: ranks %s", j.job().c_str(), j.version(),
                  j.fully_replicated() ? "fully replicated" : "UNDER-REPLICATED", Ranks(ranks).c_str());
    out += "\n";
    for (const auto& m : j.missing()) out += "      " + m + "\n";
  }
  return out;
}

std::string StalledVersionLines(const ckpt::v1::StatusReply& r) {
  if (r.stalled_versions().empty()) return "";
  std::string out = Format("\nnot committed (%d)\n", r.stalled_versions_size());
  for (const auto& v : r.stalled_versions()) {
    out += Format("  job %-16s v%-8" PRIu64 " persisted here %" PRIu64 " s ago, not committed: ",
                  v.job().c_str(), v.version(), v.waiting_s());
    out += v.missing_ranks().empty()
               ? std::string("every rank's shard is durable; the daemon of rank 0 decides the commit")
               : "no shard of rank(s) " + Ranks(v.missing_ranks()) + " of " + std::to_string(v.world_size()) +
                     " is durable (their node may be gone)";
    out += "\n";
    for (const auto& n : v.missing_nodes()) out += "      " + n + "\n";
  }
  return out;
}

std::string ErrorLines(const ckpt::v1::StatusReply& r) {
  std::string out;
  if (r.error_entries_size() == r.errors_size()) {
    for (const auto& e : r.error_entries()) {
      out += "  ";
      if (e.count() > 1)
        out += Format("[%" PRIu64 " times, last %s] ", e.count(), Ago(e.last_unix_ms()).c_str());
      out += e.message() + "\n";
    }
    return out;
  }
  for (const auto& e : r.errors()) out += "  " + e + "\n";  // a daemon that does not count them
  return out;
}

nlohmann::ordered_json StatusJson(const ckpt::v1::StatusReply& r) {
  nlohmann::ordered_json doc = ToJson(r);
  for (int i = 0; i < r.shards_size(); ++i) doc["shards"][i]["in_flight"] = InFlight(r.shards(i));
  return doc;
}

std::string ProgressBar(std::uint64_t written, std::uint64_t copied, std::uint64_t total, int width) {
  auto cells = [&](std::uint64_t part) {
    return total == 0 ? width : static_cast<int>(std::min<std::uint64_t>(part, total) * width / total);
  };
  const int w = cells(written);
  const int c = std::max(w, cells(copied));
  return "[" + std::string(w, '#') + std::string(c - w, '=') + std::string(width - c, '.') + "]";
}

std::string RenderFrame(const ckpt::v1::StatusReply& r, const std::optional<Throughput>& rate,
                        const std::string& socket) {
  std::string out;
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  out += Format("ckptd %s  pid %d  up %" PRIu64 " s  %s  %s\n", r.daemon_version().c_str(), r.pid(),
                r.uptime_s(), socket.c_str(), when);
  out += Format("pool        %s %s of %s (%d%%)\n",
                ProgressBar(r.pool_used_bytes(), r.pool_used_bytes(), r.pool_bytes(), 20).c_str(),
                Human(r.pool_used_bytes()).c_str(), Human(r.pool_bytes()).c_str(),
                Percent(r.pool_used_bytes(), r.pool_bytes()));
  if (rate) {
    out += Format("throughput  copy %s  write %s  (last %.1f s)\n", Rate(rate->copy_bytes_per_s).c_str(),
                  Rate(rate->write_bytes_per_s).c_str(), rate->interval_s);
  } else {
    out += "throughput  (from the next frame on)\n";
  }
  out += Format("totals      copied %s  written %s  read %s  %" PRIu64 " version(s) committed\n",
                Human(r.bytes_copied_total()).c_str(), Human(r.bytes_written_total()).c_str(),
                Human(r.bytes_read_total()).c_str(), r.versions_committed());
  out += "tiers      " + TierSummary(r) + "\n";
  out += Format("\nsessions (%d)\n", r.clients_size());
  for (const auto& c : r.clients()) {
    out += Format("  job %-16s rank %u/%u  pid %-7d %-6s %u items %s  last version %" PRIu64 "\n",
                  c.job().c_str(), c.rank(), c.world_size(), c.pid(), c.alive() ? "alive" : "EXITED",
                  c.items(), Human(c.tensor_bytes()).c_str(), c.last_version());
  }
  int in_flight = 0;
  for (const auto& sh : r.shards()) in_flight += InFlight(sh) ? 1 : 0;
  out += Format("\nin flight (%d)\n", in_flight);
  for (const auto& sh : r.shards()) {
    if (!InFlight(sh)) continue;
    out += Format("  job %-16s v%-6" PRIu64 " rank %-4u %-9s %s copied %3d%%  written %3d%%  of %s\n",
                  sh.job().c_str(), sh.version(), sh.rank(), LevelWord(sh.level()),
                  ProgressBar(sh.written_bytes(), sh.copied_bytes(), sh.total_bytes(), 20).c_str(),
                  Percent(sh.copied_bytes(), sh.total_bytes()), Percent(sh.written_bytes(), sh.total_bytes()),
                  Human(sh.total_bytes()).c_str());
  }
  // The finished shards: the newest few, which is what a watcher follows.
  constexpr int kFinishedShown = 5;
  int finished = 0;
  for (const auto& sh : r.shards()) finished += InFlight(sh) ? 0 : 1;
  out += Format("\nrecently done (%d, newest %d)\n", finished, std::min(finished, kFinishedShown));
  int skip = finished - kFinishedShown;
  for (const auto& sh : r.shards()) {
    if (InFlight(sh) || skip-- > 0) continue;
    out += Format("  job %-16s v%-6" PRIu64 " rank %-4u %-9s %s", sh.job().c_str(), sh.version(), sh.rank(),
                  ShardWord(sh), Human(sh.total_bytes()).c_str());
    out += sh.durable_ms() > 0 ? Format("  durable after %.1f ms", sh.durable_ms()) : std::string();
    out += ShardNote(sh) + "\n";
  }
  if (r.errors_size() > 0)
    out += Format("\nerrors (%d), newest: %s\n", r.errors_size(), r.errors().rbegin()->c_str());
  return out;
}

}  // namespace ckptctl
