#include "daemon/rpc/status_report.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <vector>

#include "proto/level_codec.h"

namespace ckpt {
namespace {

std::int64_t UnixMillis(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

// What one viewer may see of other uids' work.
class Visibility {
 public:
  Visibility(Daemon& daemon, const PeerCredentials& viewer)
      : daemon_(daemon), viewer_(viewer), all_(viewer.uid == 0 || viewer.uid == ::geteuid()) {}

  bool Session(const ckpt::Session& s) const { return all_ || s.peer.uid == viewer_.uid; }
  bool Job(const std::string& job) {
    if (all_) return true;
    auto [it, fresh] = jobs_.try_emplace(job, false);
    if (fresh) it->second = daemon_.owners().CheckAccess(job, viewer_, "see").ok();
    return it->second;
  }
  // An error line is shown if it names a job the viewer may use.
  bool Error(const std::string& line) {
    if (all_) return true;
    for (const auto& [job, visible] : jobs_) {
      if (visible && (line.find("job " + job) != std::string::npos ||
                      line.find("job '" + job + "'") != std::string::npos ||
                      line.find("/" + job + "/") != std::string::npos)) {
        return true;
      }
    }
    return false;
  }
  void NoteJob(const std::string& job) { Job(job); }

 private:
  Daemon& daemon_;
  const PeerCredentials& viewer_;
  const bool all_;
  std::map<std::string, bool> jobs_;  // checked once per report
};

void AddClients(Daemon& daemon, Visibility& visible, v1::StatusReply* reply) {
  for (const auto& sess : daemon.sessions().All()) {
    if (!visible.Session(*sess)) continue;
    visible.NoteJob(sess->job);
    auto* c = reply->add_clients();
    c->set_session(sess->id);
    c->set_job(sess->job);
    c->set_rank(sess->rank);
    c->set_world_size(sess->world_size);
    c->set_pid(sess->peer.pid);
    c->set_alive(!sess->TrainerExited());
    if (sess->mu.TryLock()) {  // never block status on a busy session
      c->set_items(static_cast<std::uint32_t>(sess->items.size()));
      c->set_tensor_bytes(sess->tensor_bytes);
      c->set_last_version(sess->last_version);
      sess->mu.Unlock();
    }
  }
}

// What became of a shard. A failure is read first: a skip or an abort is recorded with its
// error, at once, so once failed() is true the kind of failure is final.
v1::ShardState StateOf(const ShardJob& shard) {
  if (shard.failed()) {
    if (shard.skipped()) return v1::SHARD_STATE_SKIPPED;
    if (shard.aborted()) return v1::SHARD_STATE_ABORTED;
    return v1::SHARD_STATE_FAILED;
  }
  if (shard.level() >= Level::kCommitted) return v1::SHARD_STATE_COMMITTED;
  if (shard.awaiting_seal()) return v1::SHARD_STATE_UNSEALED;
  return v1::SHARD_STATE_IN_PROGRESS;
}

// The recent shards; their bytes in flight are added to the totals of finished ones.
void AddShards(Daemon& daemon, Visibility& visible, v1::StatusReply* reply) {
  std::uint64_t copied = daemon.copied_done_total(), written = daemon.written_done_total();
  std::uint32_t in_flight_shards = 0;
  std::uint64_t in_flight_bytes = 0;
  for (const auto& shard : daemon.shards().Recent()) {
    if (!visible.Job(shard->meta().job)) continue;
    auto* sh = reply->add_shards();
    sh->set_job(shard->meta().job);
    sh->set_rank(shard->meta().rank);
    sh->set_version(shard->meta().version);
    sh->set_total_bytes(shard->data_bytes());
    sh->set_copied_bytes(shard->copied_bytes.load());
    sh->set_written_bytes(shard->written_bytes.load());
    sh->set_level(LevelToProto(shard->level()));
    const v1::ShardState state = StateOf(*shard);
    if (state == v1::SHARD_STATE_SKIPPED || state == v1::SHARD_STATE_ABORTED ||
        state == v1::SHARD_STATE_FAILED)
      sh->set_error(shard->error().message());
    sh->set_state(state);
    if (state == v1::SHARD_STATE_SKIPPED) sh->set_superseded_by(shard->superseded_by());
    sh->set_aborted(state == v1::SHARD_STATE_ABORTED);
    sh->set_awaiting_seal(state == v1::SHARD_STATE_UNSEALED);
    sh->set_memory_bytes(
        daemon.tiers().memory().HeldBytes(shard->meta().job, shard->meta().version, shard->meta().rank));
    if ((state == v1::SHARD_STATE_IN_PROGRESS || state == v1::SHARD_STATE_UNSEALED) &&
        shard->level() < Level::kPersisted) {
      ++in_flight_shards;
      in_flight_bytes += shard->data_bytes();
    }
    sh->set_capture_ms(shard->MillisTo(Level::kCaptured));
    sh->set_durable_ms(shard->MillisTo(Level::kPersisted));
    if (shard->level() < Level::kPersisted && !shard->failed()) {
      copied += shard->copied_bytes.load();
      written += shard->written_bytes.load();
    }
  }
  reply->set_bytes_copied_total(copied);
  reply->set_bytes_written_total(written);
  reply->set_in_flight_shards(in_flight_shards);
  reply->set_in_flight_bytes(in_flight_bytes);
}

void AddJobUsage(v1::TierStatus* t, const std::string& job, std::uint64_t shards, std::uint64_t bytes,
                 std::uint64_t replica_shards, std::uint64_t replica_bytes) {
  auto* j = t->add_jobs();
  j->set_job(job);
  j->set_shards(shards);
  j->set_bytes(bytes);
  j->set_replica_shards(replica_shards);
  j->set_replica_bytes(replica_bytes);
  t->set_held_bytes(t->held_bytes() + bytes + replica_bytes);
}

// The tiers, and what each job holds on memory and local. A viewer who may not see a job
// sees its bytes in the tier's figures but not its name: the totals still add up, the
// hidden jobs' share shown as in one line, job "" (other jobs).
void AddTiers(Daemon& daemon, Visibility& visible, v1::StatusReply* reply) {
  const Config& config = daemon.config();
  {
    MemoryTier& memory = daemon.tiers().memory();
    auto st = memory.GetStats();
    const MemoryTier::Usage usage = memory.GetUsage();
    auto* t = reply->add_tiers();
    t->set_name("memory");
    t->set_shards(st.images);
    t->set_bytes(usage.accounted);
    t->set_budget_bytes(usage.budget);
    t->set_in_flight_bytes(usage.in_flight);
    t->set_reusable_bytes(usage.reusable);
    MemoryTier::JobUsage hidden;
    for (const auto& [job, u] : usage.jobs) {
      if (!visible.Job(job)) {
        hidden.shards += u.shards;
        hidden.bytes += u.bytes;
        hidden.replica_shards += u.replica_shards;
        hidden.replica_bytes += u.replica_bytes;
        continue;
      }
      AddJobUsage(t, job, u.shards, u.bytes, u.replica_shards, u.replica_bytes);
    }
    if (hidden.shards + hidden.replica_shards > 0)
      AddJobUsage(t, "", hidden.shards, hidden.bytes, hidden.replica_shards, hidden.replica_bytes);
    t->set_retention(memory.enabled() ? "newest " + std::to_string(config.memory_versions) +
                                            " committed version(s) per rank, within the budget"
                                      : std::string("off"));
  }
  if (const LocalTier* local = daemon.tiers().local()) {
    auto* t = reply->add_tiers();
    t->set_name("local");
    t->set_dir(local->root());
    t->set_retention("last " + std::to_string(local->keep()) + " committed versions");
    LocalTier::JobUsage hidden;
    for (const auto& [job, u] : local->Usage()) {
      if (!visible.Job(job)) {
        hidden.shards += u.shards;
        hidden.bytes += u.bytes;
        continue;
      }
      AddJobUsage(t, job, u.shards, u.bytes, 0, 0);
    }
    if (hidden.shards > 0) AddJobUsage(t, "", hidden.shards, hidden.bytes, 0, 0);
  }
  auto* t = reply->add_tiers();
  t->set_name("persistent");
  t->set_dir(config.root);
  const Catalog::Retention retention = daemon.catalog().retention();  // SIGHUP may change it
  t->set_retention(retention.keep_last == 0
                       ? std::string("every version")
                       : "last " + std::to_string(retention.keep_last) + " committed versions" +
                             (retention.keep_every
                                  ? ", and every " + std::to_string(retention.keep_every) + "th"
                                  : std::string()));
  reply->set_promotions_pending(daemon.promoter() ? daemon.promoter()->pending() : 0);
}

// A version persisted here and not committed this long after is reported with the ranks it
// waits for: a commit normally follows its last shard within a second or two, so this is a
// node gone, a rank that crashed, or a slow persistent tier, and the operator should hear
// which ranks within seconds, not after the 60 s the commit waits before giving up.
constexpr std::chrono::seconds kStalledAfter{5};
// At most this many versions are looked at per report (each costs a listing and a read of
// each daemon's marker on the persistent tier).
constexpr std::size_t kStalledShown = 4;

// "ranks 4-5: node host3 wrote them in version 41": where the missing ranks' shards came
// from in the newest committed version, by node (empty if nothing says).
std::vector<std::string> MissingNodes(Catalog& catalog, const std::string& job, std::uint64_t version,
                                      const std::vector<std::uint32_t>& missing) {
  std::vector<std::string> out;
  const std::uint64_t before = catalog.Latest(job);
  if (before == 0 || before == version) return out;
  auto claims = catalog.MarkerClaims(job, before);
  if (!claims.ok()) return out;
  std::map<std::string, std::string> by_node;
  for (std::uint32_t rank : missing) {
    auto it = claims->find(rank);
    if (it == claims->end()) continue;
    auto& ranks = by_node[Catalog::MarkerOwnerNode(it->second)];
    ranks += (ranks.empty() ? "" : ",") + std::to_string(rank);
  }
  for (const auto& [node, ranks] : by_node) {
    out.push_back("rank(s) " + ranks + ": node " + node + " wrote them in version " + std::to_string(before) +
                  " (is its daemon, or are its trainers, gone?)");
  }
  return out;
}

// The versions with a shard persisted here that have not committed kStalledAfter later, and
// the ranks no done marker claims.
void AddStalledVersions(Daemon& daemon, Visibility& visible, v1::StatusReply* reply) {
  struct Waiting {
    std::uint32_t world_size = 0;
    std::chrono::steady_clock::duration waiting{};
  };
  std::map<std::pair<std::string, std::uint64_t>, Waiting> versions;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& shard : daemon.shards().Recent()) {
    if (shard->failed() || shard->level() != Level::kPersisted) continue;
    const ShardMeta& m = shard->meta();
    if (!visible.Job(m.job)) continue;
    const auto persisted_at =
        shard->created + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double, std::milli>(shard->MillisTo(Level::kPersisted)));
    if (now - persisted_at < kStalledAfter) continue;
    auto& w = versions[{m.job, m.version}];
    w.world_size = m.world_size;
    w.waiting = std::max(w.waiting, now - persisted_at);
  }
  std::size_t shown = 0;
  for (auto it = versions.rbegin(); it != versions.rend() && shown < kStalledShown; ++it, ++shown) {
    const auto& [job, version] = it->first;
    if (daemon.catalog().IsCommitted(job, version)) continue;  // its commit is on its way here
    auto* out = reply->add_stalled_versions();
    out->set_job(job);
    out->set_version(version);
    out->set_world_size(it->second.world_size);
    out->set_waiting_s(static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::seconds>(it->second.waiting).count()));
    auto claims = daemon.catalog().MarkerClaims(job, version);
    if (!claims.ok()) continue;
    std::vector<std::uint32_t> missing;
    for (std::uint32_t r = 0; r < it->second.world_size; ++r) {
      if (!claims->count(r)) missing.push_back(r);
    }
    for (std::uint32_t r : missing) out->add_missing_ranks(r);
    for (auto& line : MissingNodes(daemon.catalog(), job, version, missing))
      out->add_missing_nodes(std::move(line));
    // Every rank durable: with replicas, the commit also waits for each rank's shard to be
    // held by R peers (their `.repl` claims), at most --replica-commit-timeout-s.
    if (missing.empty() && daemon.replicator() != nullptr && daemon.config().replica_commit_timeout_s > 0) {
      auto replicated = daemon.catalog().MarkerClaims(job, version, NodeMarkerKind::kReplicated);
      if (!replicated.ok()) continue;
      std::string ranks;
      for (std::uint32_t r = 0; r < it->second.world_size; ++r) {
        if (!replicated->count(r)) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      }
      if (!ranks.empty()) {
        out->add_missing_nodes("rank(s) " + ranks + ": not yet held by " +
                               std::to_string(daemon.replicator()->replicas()) +
                               " peer(s); the commit waits for them at most " +
                               std::to_string(daemon.config().replica_commit_timeout_s) +
                               " s (--replica-commit-timeout-s), then commits under-replicated");
      }
    }
  }
}

// Per job this daemon replicated: whether its newest committed version's shards sent from
// here are each held by R peers, by the acknowledgements.
void AddJobReplication(Daemon& daemon, Replicator& replicator, Visibility& visible, v1::StatusReply* reply) {
  for (const std::string& job : replicator.ReplicatedJobs()) {
    if (!visible.Job(job)) continue;
    const std::uint64_t version = daemon.catalog().Latest(job);
    auto* out = reply->add_job_replication();
    out->set_job(job);
    out->set_version(version);
    if (version == 0) continue;
    bool full = true;
    const auto ranks = replicator.JobReplicationOf(job, version);
    for (const auto& r : ranks) {
      auto* rank = out->add_ranks();
      rank->set_rank(r.rank);
      for (const auto& p : r.peers) rank->add_peers(p);
      if (r.peers.size() < replicator.replicas()) {
        full = false;
        // A failed send says "SHARD is held by k of R peers: why": its "held by ..." part is
        // the line; any other reason (superseded, not kept) follows the count.
        const std::string held = "held by " + std::to_string(r.peers.size()) + " of " +
                                 std::to_string(replicator.replicas()) + " peers";
        const auto at = r.error.find(" is " + held);
        out->add_missing("rank " + std::to_string(r.rank) + ": " +
                         (at != std::string::npos ? r.error.substr(at + 4)
                          : r.error.empty()       ? held
                                                  : held + ": " + r.error));
      }
    }
    out->set_fully_replicated(full && !ranks.empty());
  }
}

}  // namespace

void FillStatusReport(Daemon& daemon, const PeerCredentials& viewer, v1::StatusReply* reply) {
  Visibility visible(daemon, viewer);
  reply->set_daemon_version(CKPTD_VERSION);
  reply->set_pid(::getpid());
  reply->set_uptime_s(static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - daemon.started())
          .count()));
  reply->set_root(daemon.config().root);
  reply->set_direct_io(daemon.tiers().persistent_direct_io());
  reply->set_pool_bytes(daemon.pool().pool_bytes());
  reply->set_pool_used_bytes(daemon.pool().used_bytes());
  reply->set_chunk_bytes(daemon.pool().chunk_bytes());
  reply->set_pool_numa(daemon.config().pool_numa.Name() + ": " + daemon.pool().numa_nodes());
  reply->set_device_backend(daemon.DescribeBackend());
  AddClients(daemon, visible, reply);
  AddShards(daemon, visible, reply);
  for (const ErrorLog::Entry& e : daemon.errors().Entries()) {
    if (!visible.Error(e.message)) continue;
    reply->add_errors(e.message);
    auto* out = reply->add_error_entries();
    out->set_message(e.message);
    out->set_count(e.count);
    out->set_first_unix_ms(UnixMillis(e.first));
    out->set_last_unix_ms(UnixMillis(e.last));
  }
  reply->set_bytes_read_total(daemon.restore_counters().bytes_read);
  reply->set_versions_committed(daemon.versions_committed());
  const RestoreCounters& restored = daemon.restore_counters();
  reply->set_restored_bytes_memory(restored.from_memory);
  reply->set_restored_bytes_local(restored.from_local);
  reply->set_restored_bytes_persistent(restored.from_persistent);
  reply->set_restores_resharded(restored.resharded);
  reply->set_restored_bytes_peer(restored.from_peer);
  reply->set_restores_uncommitted(restored.uncommitted);
  AddTiers(daemon, visible, reply);
  if (ErasureGroup* e = daemon.erasure()) {
    reply->set_erasure(e->Describe());
    reply->set_erasure_parity_bytes(e->parity_bytes());
    const ErasureGroup::Counters c = e->counters();
    reply->set_erasure_chunks_sent(c.chunks_sent);
    reply->set_erasure_send_failures(c.send_failures);
    reply->set_erasure_rebuilds(c.rebuilds);
    reply->set_erasure_rebuild_failures(c.rebuild_failures);
    reply->set_erasure_corrupt_fragments(c.corrupt_fragments);
    reply->set_erasure_pending(c.pending);
  }
  if (Replicator* r = daemon.replicator()) {
    reply->set_replicas(r->replicas());
    reply->set_peer_address(r->peers().self_address());
    reply->set_replicated_shards(r->replicated_shards());
    reply->set_replication_failures(r->failures());
    for (const auto& p : r->Peers()) {
      auto* out = reply->add_peers();
      out->set_address(p.address);
      out->set_held_bytes(p.held_bytes);
      out->set_sent_bytes_held(p.sent_bytes_held);
      if (p.sent_said_at != std::chrono::system_clock::time_point{}) {
        out->set_sent_bytes_held_unix_ms(UnixMillis(p.sent_said_at));
      }
      out->set_holder(p.holder);
      out->set_error(p.error);
    }
    AddJobReplication(daemon, *r, visible, reply);
  }
  AddStalledVersions(daemon, visible, reply);
}

}  // namespace ckpt
