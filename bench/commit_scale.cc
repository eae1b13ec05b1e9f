// ckpt-commit-scale: the commit protocol of N daemons x R ranks on one shared directory,
// in one process. Each simulated daemon is the real thing's commit stage: its own Catalog,
// ShardRegistry and CommitTracker (with its watcher thread), as ckptd builds them, all on
// one CountingStorage over the shared root. What is simulated is only the rest of the
// daemon: each rank registers once (Catalog::WriteRankRegistration, as the registrar does),
// and for each version every rank's shard is admitted (ShardRegistry::Add) and then, at a
// random moment within --node-spread-ms (per daemon) + --rank-spread-ms (per rank), made
// "durable" (CommitTracker::OnPersisted, as the flush engine calls it; no shard bytes are
// written, their files are the format's and cost the same under any commit protocol).
//
// Measured per version: the metadata operations of the whole protocol (markers, the
// decision, COMMITTED, `latest`, every daemon's polling), by kind; and the commit latency,
// from the moment the last shard became durable to the moment the last daemon saw the
// commit (its on_committed hook). Prints one JSON object.
//
// The same source builds against older trees (bench/commit_scale.sh builds it at the
// baseline commit too), so it uses only interfaces the old protocol had.
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "daemon/catalog/catalog.h"
#include "signal_cleanup.h"
#include "daemon/commit/commit_tracker.h"
#include "daemon/io/counting_storage.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/pipeline/shard_registry.h"
#include "format/paths.h"

using namespace ckpt;
using Clock = std::chrono::steady_clock;

namespace {

constexpr char kJob[] = "scale";

// A catalog named after its node where the protocol has node markers (each simulated
// daemon is a node); the old protocol's catalog had no node.
template <typename C = Catalog>
std::unique_ptr<C> MakeCatalog(std::shared_ptr<Storage> storage, const std::string& root,
                               const std::string& node) {
  if constexpr (std::is_constructible_v<C, std::shared_ptr<Storage>, std::string, std::uint32_t,
                                        std::uint32_t, Catalog::Reporter, std::string>) {
    return std::make_unique<C>(std::move(storage), root, 0, 0, nullptr, node);
  } else {
    (void)node;
    return std::make_unique<C>(std::move(storage), root, 0, 0, nullptr);
  }
}

struct Node {
  std::unique_ptr<Catalog> catalog;
  ShardRegistry shards;
  std::unique_ptr<CommitTracker> tracker;
};

// Commits seen, per version: how many daemons, and when the last one saw it.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint64_t, std::pair<std::uint32_t, Clock::time_point>> by_version;
  std::atomic<std::uint64_t> failures{0};
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

std::string OpsJson(const MetaOps& o, double per) {
  auto f = [&](std::uint64_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(n) / per);
    return std::string(buf);
  };
  return "{\"open\":" + f(o.open) + ",\"stat\":" + f(o.stat) + ",\"readdir\":" + f(o.readdir) +
         ",\"rename\":" + f(o.rename) + ",\"unlink\":" + f(o.unlink) + ",\"mkdir\":" + f(o.mkdir) +
         ",\"link\":" + f(o.link) + ",\"fsync\":" + f(o.fsync) + ",\"total\":" + f(o.total()) + "}";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"commit protocol of N daemons x R ranks on one shared directory"};
  std::string root, fs_label = "tmpfs";
  std::uint32_t nodes = 8, ranks_per_node = 8, versions = 3, workers = 16;
  double node_spread_ms = 20, rank_spread_ms = 5, timeout_s = 120;
  app.add_option("--root", root, "the shared directory (created; must be empty)")->required();
  app.add_option("--nodes", nodes, "simulated daemons")->check(CLI::Range(1u, 100000u));
  app.add_option("--ranks-per-node", ranks_per_node)->check(CLI::Range(1u, 1024u));
  app.add_option("--versions", versions)->check(CLI::Range(1u, 1000u));
  app.add_option("--workers", workers, "threads that make shards durable")->check(CLI::Range(1u, 256u));
  app.add_option("--node-spread-ms", node_spread_ms, "daemons finish within this");
  app.add_option("--rank-spread-ms", rank_spread_ms, "ranks of one daemon finish within this");
  app.add_option("--timeout-s", timeout_s, "longest wait for one commit");
  app.add_option("--fs", fs_label, "label of the file system, for the JSON");
  CLI11_PARSE(app, argc, argv);
  bench::SignalCleanup::Install().Add(root);  // the script removes it after a normal exit

  spdlog::set_level(spdlog::level::warn);
  std::filesystem::create_directories(root);
  auto counting = std::make_shared<CountingStorage>(std::make_shared<PosixStorage>());
  const std::uint32_t world = nodes * ranks_per_node;
  Seen seen;

  std::vector<std::unique_ptr<Node>> daemons;
  daemons.reserve(nodes);
  for (std::uint32_t d = 0; d < nodes; ++d) {
    auto n = std::make_unique<Node>();
    n->catalog = MakeCatalog(counting, root, "n" + std::to_string(d));
    CommitTracker::Hooks hooks;
    hooks.on_committed = [&seen](const std::string&, std::uint64_t v) {
      std::lock_guard lock(seen.mu);
      auto& s = seen.by_version[v];
      ++s.first;
      s.second = Clock::now();
      seen.cv.notify_all();
    };
    hooks.on_shard_failed = [&seen](const std::shared_ptr<ShardJob>& s) {
      ++seen.failures;
      std::fprintf(stderr, "shard failed: %s\n", s->error().message().c_str());
    };
    hooks.on_error = [](const std::string& m) { std::fprintf(stderr, "error: %s\n", m.c_str()); };
    n->tracker = std::make_unique<CommitTracker>(*n->catalog, n->shards, hooks);
    n->tracker->Start();
    daemons.push_back(std::move(n));
  }
  auto registration = [](std::uint32_t rank) { return "reg" + std::to_string(rank) + ".1"; };

  // Each rank registers once (the registrar's write), before any snapshot.
  const MetaOps at_start = counting->counts();
  for (std::uint32_t d = 0; d < nodes; ++d) {
    for (std::uint32_t i = 0; i < ranks_per_node; ++i) {
      const std::uint32_t rank = d * ranks_per_node + i;
      if (Status s = daemons[d]->catalog->WriteRankRegistration(kJob, rank, registration(rank)); !s.ok()) {
        std::fprintf(stderr, "registration of rank %u: %s\n", rank, s.message().c_str());
        return 1;
      }
    }
  }
  const MetaOps registered = counting->counts();
  // Every daemon learns the job's newest committed version once (Snapshot admission asks).
  for (auto& n : daemons) n->catalog->Latest(kJob);
  const MetaOps before = counting->counts();

  std::mt19937_64 rng(42);
  std::vector<double> latencies;
  const CheckpointTree tree(root);
  const auto wall0 = Clock::now();
  for (std::uint64_t v = 1; v <= versions; ++v) {
    std::filesystem::create_directories(tree.VersionDir(kJob, v));  // the flush engine's, not the commit's
    struct Event {
      Clock::time_point due;
      std::uint32_t node, rank;
      std::shared_ptr<ShardJob> shard;
    };
    std::vector<Event> events;
    events.reserve(world);
    const auto t0 = Clock::now() + std::chrono::milliseconds(5);
    std::uniform_real_distribution<double> node_delay(0, node_spread_ms), rank_delay(0, rank_spread_ms);
    for (std::uint32_t d = 0; d < nodes; ++d) {
      const double nd = node_delay(rng);
      for (std::uint32_t i = 0; i < ranks_per_node; ++i) {
        const std::uint32_t rank = d * ranks_per_node + i;
        ShardMeta meta{kJob, v, rank, world, registration(rank)};
        auto shard = std::make_shared<ShardJob>(ShardLayout::Unplanned(meta, {}), std::vector<ItemSource>{},
                                                tree.VersionDir(kJob, v), false);
        (void)daemons[d]->shards.Add(shard);  // admitted at snapshot time (what it lets go is freed here)
        const auto due = t0 + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double, std::milli>(nd + rank_delay(rng)));
        events.push_back({due, d, rank, std::move(shard)});
      }
    }
    std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) { return a.due < b.due; });
    std::atomic<std::size_t> next{0};
    std::atomic<Clock::rep> last_durable{0};
    std::vector<std::thread> pool;
    for (std::uint32_t w = 0; w < std::min<std::uint32_t>(workers, world); ++w) {
      pool.emplace_back([&] {
        for (std::size_t i; (i = next.fetch_add(1)) < events.size();) {
          const Event& e = events[i];
          std::this_thread::sleep_until(e.due);
          const auto now = Clock::now().time_since_epoch().count();
          for (auto seen_last = last_durable.load();
               now > seen_last && !last_durable.compare_exchange_weak(seen_last, now);) {
          }
          daemons[e.node]->tracker->OnPersisted(e.shard->meta(), e.shard);
        }
      });
    }
    for (auto& t : pool) t.join();
    std::unique_lock lock(seen.mu);
    const bool all = seen.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
      auto it = seen.by_version.find(v);
      return it != seen.by_version.end() && it->second.first == nodes;
    });
    if (!all) {
      std::fprintf(stderr, "version %llu: not seen committed by every daemon within %.0f s\n",
                   static_cast<unsigned long long>(v), timeout_s);
      return 1;
    }
    const Clock::time_point last(Clock::duration(last_durable.load()));
    latencies.push_back(Ms(seen.by_version[v].second - last));
  }
  const double wall_s = std::chrono::duration<double>(Clock::now() - wall0).count();
  // Every daemon's watcher is idle again (nothing awaited) before the count is taken.
  for (auto& n : daemons) n->tracker->Stop();
  const MetaOps after = counting->counts();

  std::string protocol = "unknown";
  if (auto names = PosixStorage().List(tree.VersionDir(kJob, 1)); names.ok()) {
    for (const auto& name : names.value()) {
      if (name.starts_with("node-")) protocol = "per-node";
      if (protocol == "unknown" && name.starts_with("rank-") && name.ends_with(".done"))
        protocol = "per-rank";
    }
  }
  std::sort(latencies.begin(), latencies.end());
  const double p50 = latencies[latencies.size() / 2];
  std::printf(
      "{\"fs\":\"%s\",\"nodes\":%u,\"ranks_per_node\":%u,\"protocol\":\"%s\",\"versions\":%u,"
      "\"meta_ops_per_version\":%s,\"registration_ops\":%s,\"commit_latency_ms_p50\":%.2f,"
      "\"commit_latency_ms_max\":%.2f,\"failures\":%llu,\"wall_s\":%.2f}\n",
      fs_label.c_str(), nodes, ranks_per_node, protocol.c_str(), versions,
      OpsJson(after - before, versions).c_str(), OpsJson(registered - at_start, 1).c_str(), p50,
      latencies.back(), static_cast<unsigned long long>(seen.failures.load()), wall_s);
  return seen.failures.load() == 0 ? 0 : 1;
}
