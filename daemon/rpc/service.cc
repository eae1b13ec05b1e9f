#include "daemon/rpc/service.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>

#include "common/names.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/exposition/exposition.h"
#include "daemon/rpc/convert.h"
#include "daemon/rpc/jobs_report.h"
#include "daemon/rpc/status_report.h"
#include "daemon/rpc/warm_start_rpc.h"
#include "proto/level_codec.h"

namespace ckpt {
namespace {

// Waits longer than this are waits without limit (and never overflow a deadline).
constexpr std::uint64_t kMaxWaitMs = 30ull * 24 * 3600 * 1000;

// Why a wait on `v` finds no shard of this registration, and what to do instead.
std::string UntrackedVersionMessage(const Session& s, std::uint64_t v) REQUIRES(s.mu) {
  const std::string ver = "version " + std::to_string(v);
  const std::string ls = "; `ckptctl ls --job " + s.job + "` shows which versions are committed";
  if (s.shards.empty() || v > s.last_version) {
    return ver + " was not snapshotted by this registration of job '" + s.job + "' (rank " +
           std::to_string(s.rank) + ")" +
           (s.last_version ? ", whose newest snapshot is version " + std::to_string(s.last_version) : "") + ls;
  }
  const std::uint64_t oldest = s.shards.begin()->first;
  if (v < oldest) {
    return ver + " is older than the versions this registration still tracks (from " + std::to_string(oldest) +
           " on; a registration keeps its newest snapshots only, and versions of an earlier process are not "
           "its own): `ckptctl ls --job " + s.job + "` shows whether it is committed, and a reader " +
           "(ckpt.load_version, ckpt.torch.load_checkpoint) opens any committed version";
  }
  return ver + " was not snapshotted by this registration of job '" + s.job + "' (it snapshotted versions " +
         std::to_string(oldest) + ".." + std::to_string(s.last_version) + " with gaps)" + ls;
}

}  // namespace

std::string CheckpointService::NewDaemonInstanceId() {
  std::random_device rd;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

Result<std::shared_ptr<Session>> CheckpointService::FindSession(grpc::ServerContext* ctx,
                                                                const std::string& id) {
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return peer.status();
  return daemon_.sessions().Find(id, peer->uid);
}

grpc::Status CheckpointService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                         v1::RegisterReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return ToGrpc(peer.status());
  if (std::string err = CheckJobId(req->job()); !err.empty()) return ToGrpc(InvalidArgument(err));
  if (req->world_size() == 0 || req->world_size() > kMaxWorldSize) {
    return ToGrpc(InvalidArgument("world size " + std::to_string(req->world_size()) + " is not in [1, " +
                                  std::to_string(kMaxWorldSize) + "]"));
  }
  if (req->rank() >= req->world_size()) {
    return ToGrpc(InvalidArgument("rank " + std::to_string(req->rank()) + " is outside world size " +
                                  std::to_string(req->world_size())));
  }
  RegistrationRequest registration = FromProto(*req);
  if (daemon_.config().verify_snapshots) registration.verify = true;
  Result<Registered> done = Registered{};
  if (req->session().empty()) {
    done = daemon_.registrar().Register(registration, peer.value(), gate_.CancelCheckOf(ctx));
  } else {
    auto s = daemon_.sessions().Find(req->session(), peer->uid);
    if (!s.ok()) return ToGrpc(s.status());
    done = daemon_.registrar().Reregister(s.value(), registration, gate_.CancelCheckOf(ctx));
  }
  if (!done.ok()) return gate_.Reply(done.status());
  ToProto(done.value(), reply);
  reply->set_daemon_instance(instance_);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Snapshot(grpc::ServerContext* ctx, const v1::SnapshotRequest* req,
                                         v1::SnapshotReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto s = FindSession(ctx, req->session());
  if (!s.ok()) return ToGrpc(s.status());
  if (req->has_previous_stall_ns()) {
    // The stall happened whatever becomes of this snapshot.
    metrics::Metrics().SnapshotStall(static_cast<double>(req->previous_stall_ns()) / 1e9);
  }
  Session& session = *s.value();
  MutexLock lock(session.mu);
  auto shard = daemon_.admission().Admit(session, FromProto(*req), gate_.CancelCheckOf(ctx));
  if (!shard.ok()) return gate_.Reply(shard.status());
  reply->set_data_bytes(shard.value()->data_bytes());
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Wait(grpc::ServerContext* ctx, const v1::WaitRequest* req,
                                     v1::WaitReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto s = FindSession(ctx, req->session());
  if (!s.ok()) return ToGrpc(s.status());
  const Level want = LevelFromProto(req->level());
  if (want == Level::kNone) {
    return ToGrpc(InvalidArgument(
        "wait needs a level: captured, local, persisted (durable), committed or replicated"));
  }
  if (want == Level::kReplicated && daemon_.replicator() == nullptr) {
    return ToGrpc(FailedPrecondition(
        "wait for level replicated: replication is off on this daemon (--replicas 0); start ckptd with "
        "--replicas R --peer-listen ADDR:PORT --peers ... --peer-secret FILE, or wait for another level"));
  }
  std::shared_ptr<ShardJob> shard;
  {
    Session& session = *s.value();
    MutexLock lock(session.mu);
    auto it = session.shards.find(req->version());
    if (it == session.shards.end()) {
      return ToGrpc(NotFound(UntrackedVersionMessage(session, req->version())));
    }
    shard = it->second;
  }
  if (req->stream_ordered() && want != Level::kCaptured) {
    return ToGrpc(InvalidArgument("a stream-ordered wait is for level captured only"));
  }
  const auto deadline = req->timeout_ms() == 0 || req->timeout_ms() > kMaxWaitMs
                            ? std::chrono::steady_clock::time_point::max()
                            : std::chrono::steady_clock::now() + std::chrono::milliseconds(req->timeout_ms());
  // Stream-ordered waits of host-memory sessions are plain waits.
  const bool ordered = req->stream_ordered() && shard->sync() != nullptr;
  bool ordered_only = false;
  if (req->seal() && shard->sealed_registration()) {
    if (ckpt::Status st = SealAtWait(ctx, shard, ordered, deadline); !st.ok()) {
      if (st.code() == ckpt::StatusCode::kCancelled) return gate_.Reply(st);
      shard->ClaimErrorReport();
      return ToGrpc(st.With("version " + std::to_string(req->version()) + " failed"));
    }
  }
  spdlog::debug("job {} rank {}: waiting for version {} to be {}", s.value()->job, s.value()->rank,
                req->version(), LevelName(want));
  ckpt::Status st = WaitInSlices(deadline, gate_.CancelCheckOf(ctx), [&](auto slice_end) {
    if (want == Level::kReplicated) {  // acknowledged by R peers
      return daemon_.replicator()->WaitReplicated(shard->meta().job, shard->meta().version, shard->meta().rank,
                                                  slice_end);
    }
    return ordered ? shard->WaitOrdered(slice_end, &ordered_only) : shard->WaitFor(want, slice_end);
  });
  if (st.code() == ckpt::StatusCode::kCancelled) return gate_.Reply(st);  // nobody hears a failure now
  if (!st.ok()) {
    if (shard->failed()) {
      shard->ClaimErrorReport();
      st = st.With("version " + std::to_string(req->version()) + " failed");
    }
    return ToGrpc(st);
  }
  if (ordered_only) {
    reply->set_reached(v1::LEVEL_UNSPECIFIED);
    reply->set_has_daemon_event(true);
    reply->set_daemon_event_slot(shard->sync()->daemon_slot());
    if (auto value = shard->sync()->release_value()) reply->set_release_value(*value);
    return grpc::Status::OK;
  }
  reply->set_reached(LevelToProto(shard->level()));
  return grpc::Status::OK;
}

ckpt::Status CheckpointService::SealAtWait(grpc::ServerContext* ctx, const std::shared_ptr<ShardJob>& shard,
                                          bool ordered, std::chrono::steady_clock::time_point deadline) {
  // Host memory: the seal vouches for the memory up to the end of the copy, so it waits for
  // the capture. A stream-ordered wait seals at once: what the trainer queues after it runs
  // after the copies.
  if (!ordered) {
    ckpt::Status st = WaitInSlices(deadline, gate_.CancelCheckOf(ctx), [&](auto slice_end) {
      return shard->WaitFor(Level::kCaptured, slice_end);
    });
    if (!st.ok()) return st;
    if (shard->verify()) {
      if (ckpt::Status v = shard->Verify(); !v.ok()) {
        (void)daemon_.AbortShard(shard, v);
        return v;
      }
    }
  }
  return daemon_.SealShard(shard);
}

grpc::Status CheckpointService::Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortReply*) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto s = FindSession(ctx, req->session());
  if (!s.ok()) return ToGrpc(s.status());
  if (req->reason().size() > 1024) {
    return ToGrpc(InvalidArgument("abort reason is " + std::to_string(req->reason().size()) +
                                  " bytes; at most 1024"));
  }
  std::shared_ptr<ShardJob> shard;
  {
    Session& session = *s.value();
    MutexLock lock(session.mu);
    auto it = session.shards.find(req->version());
    if (it == session.shards.end()) return ToGrpc(NotFound(UntrackedVersionMessage(session, req->version())));
    shard = it->second;
  }
  if (!shard->sealed_registration()) {
    return ToGrpc(FailedPrecondition("version " + std::to_string(req->version()) +
                                     " is of a registration that does not seal its versions: register with "
                                     "sealed (or verify) to abort versions"));
  }
  if (shard->aborted()) return grpc::Status::OK;  // aborted already, for this reason or another
  const std::string reason = req->reason().empty() ? std::string("aborted by the trainer") : req->reason();
  // The caller knows: its next snapshot does not report this as an earlier failure.
  ckpt::Status st = daemon_.AbortShard(shard, Aborted("torn snapshot: " + reason));
  if (st.ok()) shard->ClaimErrorReport();
  return ToGrpc(st);
}

grpc::Status CheckpointService::Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                                        v1::RestoreReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto s = FindSession(ctx, req->session());
  if (!s.ok()) return ToGrpc(s.status());
  Session& session = *s.value();
  MutexLock lock(session.mu);
  auto restored = daemon_.restorer().Restore(session, req->version(), gate_.CancelCheckOf(ctx));
  if (!restored.ok()) return gate_.Reply(restored.status());
  ToProto(std::move(restored).value(), reply);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::List(grpc::ServerContext* ctx, const v1::ListRequest* req,
                                     v1::ListReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  if (ckpt::Status st = AuthorizeJob(ctx, req->job(), "list"); !st.ok()) return ToGrpc(st);
  auto versions = daemon_.tiers().List(req->job());
  if (!versions.ok()) return ToGrpc(versions.status());
  Replicator::ReplicaMap replicas;
  if (Replicator* r = daemon_.replicator()) {
    reply->mutable_replica_map()->set_replicas(r->replicas());
    // Only for a job with versions here: a List of any id must not cost a call to every peer.
    if (!versions->empty()) {
      replicas = r->ReplicaMapOf(req->job(), req->ask_peers());
      reply->mutable_replica_map()->set_source(replicas.source);
      for (const auto& u : replicas.unanswered) reply->mutable_replica_map()->add_unanswered(u);
    }
  }
  for (const auto& [version, on_tiers] : versions.value()) {
    v1::VersionInfo* info = reply->add_versions();
    ToProto(version, on_tiers, info);
    for (auto it = replicas.holders.lower_bound({version, 0});
         it != replicas.holders.end() && it->first.first == version; ++it) {
      auto* holders = info->add_replica_holders();
      holders->set_rank(it->first.second);
      for (const auto& peer : it->second) holders->add_peers(peer);
    }
  }
  reply->set_latest(daemon_.catalog().RefreshLatest(req->job()));
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*,
                                       v1::StatusReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return ToGrpc(peer.status());
  FillStatusReport(daemon_, peer.value(), reply);
  FillWarmStartStatus(daemon_, peer.value(), reply);
  reply->set_daemon_instance(instance_);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Unregister(grpc::ServerContext* ctx, const v1::UnregisterRequest* req,
                                           v1::UnregisterReply*) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto s = FindSession(ctx, req->session());
  if (!s.ok()) return ToGrpc(s.status());
  const std::string job = s.value()->job;
  daemon_.sessions().Unregister(s.value(), gate_.CancelCheckOf(ctx));
  // A trainer that ends is not a job that finished: a crash or a failed collective ends every
  // trainer of a job too, and its restart restores from the memory images and the peers'
  // replicas. Only a trainer that says the job is finished lets them go, once it is the last
  // one of the job here.
  // Any trainer of the job may say so (often rank 0 alone does): it is acted on when the
  // job's last trainer here is gone.
  bool finish = false;
  {
    MutexLock lock(finishing_mu_);
    if (req->finished()) finishing_.insert(job);
    if (finishing_.count(job) != 0 && !HasSessionOf(job)) {
      finishing_.erase(job);
      finish = true;
    }
  }
  if (finish) {
    v1::FinishJobReply dropped;
    FinishJobHere(job, &dropped);
  }
  return grpc::Status::OK;
}

ckpt::Status CheckpointService::AuthorizeJob(grpc::ServerContext* ctx, const std::string& job,
                                             std::string_view action) {
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return peer.status();
  if (std::string err = CheckJobId(job); !err.empty()) return InvalidArgument(err);
  return daemon_.owners().CheckAccess(job, peer.value(), action);
}

bool CheckpointService::HasSessionOf(const std::string& job) {
  const auto all = daemon_.sessions().All();
  return std::any_of(all.begin(), all.end(), [&](const auto& other) { return other->job == job; });
}

void CheckpointService::FinishJobHere(const std::string& job, v1::FinishJobReply* reply) {
  std::uint64_t bytes = 0;
  const std::uint32_t images = daemon_.memory().DropJob(job, daemon_.catalog().RefreshLatest(job), &bytes);
  reply->set_memory_images_dropped(images);
  reply->set_memory_bytes_dropped(bytes);
  if (Replicator* r = daemon_.replicator()) {
    const Replicator::JobDropped told = r->OnJobFinished(job);
    reply->set_peers_told(told.told);
    reply->set_peers_dropped(told.dropped);
  }
  if (ErasureGroup* e = daemon_.erasure()) e->OnJobFinished(job);
  spdlog::info(
      "job {} finished: dropped {} memory image(s) ({} bytes); {} of {} peer(s) dropped the replicas sent "
      "them",
      job, images, bytes, reply->peers_dropped(), reply->peers_told());
}

grpc::Status CheckpointService::FinishJob(grpc::ServerContext* ctx, const v1::FinishJobRequest* req,
                                          v1::FinishJobReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  if (ckpt::Status st = AuthorizeJob(ctx, req->job(), "finish"); !st.ok()) return ToGrpc(st);
  if (HasSessionOf(req->job())) {
    return ToGrpc(
        FailedPrecondition("job '" + req->job() +
                           "' still has a registered trainer on this daemon; finish it once its trainers "
                           "have exited (its memory images and replicas are what a restart restores from)"));
  }
  FinishJobHere(req->job(), reply);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::Prefetch(grpc::ServerContext* ctx, const v1::PrefetchRequest* req,
                                         v1::PrefetchReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  if (ckpt::Status st = AuthorizeJob(ctx, req->job(), "prefetch"); !st.ok()) return ToGrpc(st);
  std::vector<std::uint32_t> ranks(req->ranks().begin(), req->ranks().end());
  auto done = daemon_.tiers().Prefetch(req->job(), req->version(), std::move(ranks));
  if (!done.ok()) return ToGrpc(done.status());
  daemon_.restore_counters().bytes_read += done->bytes;
  ToProto(done.value(), reply);
  spdlog::info("job {}: prefetched version {} ({} rank(s): {} to local, {} to memory, {} differential left, {} "
               "bytes read)",
               req->job(), done->version, done->ranks, done->local_shards, done->memory_shards,
               done->differential_shards, done->bytes);
  return grpc::Status::OK;
}

grpc::Status CheckpointService::WarmStart(grpc::ServerContext* ctx, const v1::WarmStartRequest* req,
                                          v1::WarmStartReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return ToGrpc(peer.status());
  return HandleWarmStart(daemon_, peer.value(), *req, reply);
}

grpc::Status CheckpointService::Jobs(grpc::ServerContext* ctx, const v1::JobsRequest*, v1::JobsReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return ToGrpc(peer.status());
  return ToGrpc(FillJobsReport(daemon_, peer.value(), reply));
}

grpc::Status CheckpointService::GetMetrics(grpc::ServerContext* ctx, const v1::GetMetricsRequest*,
                                           v1::GetMetricsReply* reply) {
  auto pass = gate_.Enter();
  if (!pass) return CallGate::Refusal();
  auto peer = auth_.Check(ctx->peer());
  if (!peer.ok()) return ToGrpc(peer.status());
  metrics::LabelFilter filter;
  if (peer->uid != 0 && peer->uid != ::geteuid()) {
    // As in Status: another uid learns nothing of jobs it may not use.
    filter = [this, viewer = peer.value(),
              seen = std::map<std::string, bool>()](const metrics::Labels& labels) mutable {
      for (const auto& [name, value] : labels) {
        if (name != "job") continue;
        auto [it, fresh] = seen.try_emplace(value, false);
        if (fresh) it->second = daemon_.owners().CheckAccess(value, viewer, "see").ok();
        return it->second;
      }
      return true;
    };
  }
  reply->set_text(metrics::RenderMetrics(daemon_, filter));
  return grpc::Status::OK;
}

}  // namespace ckpt
