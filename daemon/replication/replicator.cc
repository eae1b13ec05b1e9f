#include "daemon/replication/replicator.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "ckpt/v1/peer.grpc.pb.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replication/peer_protocol.h"
#include "daemon/replication/progress_watch.h"
#include "daemon/replication/shard_stream.h"
#include "proto/grpc_status.h"

namespace ckpt {
namespace {

constexpr std::size_t kStatesKept = 8192;  // replication states remembered

}  // namespace

std::string Replicator::Stalled(const std::string& peer, std::chrono::milliseconds limit) {
  return "peer " + peer + " moved no byte for " + std::to_string(limit.count() / 1000) +
         " s (--peer-progress-timeout-s): given up";
}

std::string Replicator::ProofOf(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(PeerSecret::kProofKey);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

Replicator::Replicator(PeerList peers, PeerSecret secret, MemoryTier& memory, Hooks hooks,
                       std::chrono::milliseconds progress_timeout, bool deltas)
    : peers_(std::move(peers)),
      secret_(std::move(secret)),
      memory_(memory),
      hooks_(std::move(hooks)),
      progress_timeout_(progress_timeout),
      deltas_(deltas) {}

Result<std::unique_ptr<Replicator>> Replicator::Create(const Config& config, MemoryTier& memory, Hooks hooks,
                                                      ParityStore* parity) {
  auto secret = PeerSecret::Load(config.peer_secret);
  if (!secret.ok()) return secret.status();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const char* slurm = std::getenv("SLURM_JOB_NODELIST");
  auto peers = ResolvePeers(config.peers, config.peer_listen, config.replicas, slurm ? slurm : "", host);
  if (!peers.ok()) return peers.status();
  if (!memory.enabled()) {
    return InvalidArgument("--replicas " + std::to_string(config.replicas) +
                           " needs a memory tier (--memory-mib and --memory-versions above 0): replicas live there");
  }
  std::unique_ptr<Replicator> r(new Replicator(std::move(peers).value(), std::move(secret).value(), memory,
                                               std::move(hooks), std::chrono::seconds(config.peer_progress_timeout_s),
                                               config.replica_deltas));
  const PeerAcceptor::Limits limits =
      PeerAcceptor::LimitsOf(config.peer_max_connections, config.peer_max_connections_per_address);
  auto server = PeerServer::Start(config.peer_listen, limits, memory, parity, r->secret_, r->peers_.self_address());
  if (!server.ok()) return server.status();
  r->server_ = std::move(server).value();
  r->bound_ = r->server_->bound();
  r->sender_ = std::thread([p = r.get()] { p->SendLoop(); });
  std::string holders;
  for (std::size_t i : r->peers_.Holders()) holders += (holders.empty() ? "" : ", ") + r->peers_.addresses[i];
  spdlog::info(
      "replication: {} replica(s) of each shard, to {}; peer server on {} (daemon {} of {} in --peers; connections "
      "at most {}, {} per remote address)",
      config.replicas, holders, r->bound_, r->peers_.self + 1, r->peers_.addresses.size(), limits.total,
      limits.per_address);
  return r;
}

Replicator::~Replicator() { Stop(); }

void Replicator::Stop() {
  {
    MutexLock lock(mu_);
    if (stopping_ && !sender_.joinable() && !server_) return;
    stopping_ = true;
  }
  changed_.SignalAll();
  if (sender_.joinable()) sender_.join();
  server_.reset();
}

std::shared_ptr<grpc::Channel> Replicator::ChannelTo(const std::string& peer) {
  MutexLock lock(mu_);
  auto& ch = channels_[peer];
  if (!ch) ch = NewPeerChannel(peer);
  return ch;
}

void Replicator::Enqueue(std::shared_ptr<MemoryImage> image) {
  if (!image) return;
  const ShardMeta m = image->meta;
  {
    MutexLock lock(mu_);
    if (stopping_) return;
    // A newer version of the rank supersedes one not sent yet.
    for (auto it = queue_.begin(); it != queue_.end();) {
      const ShardMeta& q = it->meta;
      if (q.job == m.job && q.rank == m.rank && q.version < m.version) {
        Key k{q.job, q.version, q.rank};
        auto& st = states_[k];
        st.done = true;
        st.error = FailedPrecondition(DescribeShard(q.job, q.version, q.rank) + " was superseded by version " +
                                      std::to_string(m.version) + " before it was sent to its peers");
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    Key key{m.job, m.version, m.rank};
    if (!states_.count(key)) state_order_.push_back(key);
    states_[key] = State{};
    while (state_order_.size() > kStatesKept) {
      states_.erase(state_order_.front());
      state_order_.pop_front();
    }
    queue_.push_back(Queued{m, image});
  }
  changed_.SignalAll();
}

void Replicator::NotReplicable(const ShardMeta& meta, const std::string& why) {
  Key key{meta.job, meta.version, meta.rank};
  {
    MutexLock lock(mu_);
    if (!states_.count(key)) state_order_.push_back(key);
    auto& st = states_[key];
    if (st.done) return;
    st.done = true;
    st.error = FailedPrecondition(DescribeShard(meta.job, meta.version, meta.rank) + " is not replicated: " + why);
  }
  changed_.SignalAll();
}

void Replicator::Finish(const Key& key, Status st, std::uint32_t acks) {
  {
    MutexLock lock(mu_);
    auto it = states_.find(key);
    if (it == states_.end()) return;
    it->second.acks = acks;
    it->second.done = true;
    it->second.error = std::move(st);
  }
  changed_.SignalAll();
}

void Replicator::NoteError(const std::string& peer, const std::string& error) {
  MutexLock lock(mu_);
  peer_error_[peer] = error;
}

Status Replicator::WaitReplicated(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                  std::chrono::steady_clock::time_point deadline) {
  Key key{job, version, rank};
  MutexLock lock(mu_);
  for (;;) {
    auto it = states_.find(key);
    if (it != states_.end() && it->second.done) {
      if (!it->second.error.ok()) return it->second.error;
      return Status::Ok();
    }
    if (stopping_) return Cancelled("the daemon is stopping");
    if (!changed_.WaitUntil(mu_, deadline)) {
      return DeadlineExceeded("version " + std::to_string(version) + " is not replicated yet");
    }
  }
}

Status Replicator::Unproven(const std::string& peer, const Status& why) {
  metrics::Metrics().Replication(metrics::ReplicationEvent::kUnproven);
  unproven_log_.Warn("replication: peer " + peer + ": " + why.message());
  return PermissionDenied(why.message());
}

void Replicator::Pace() {
  // Yield to the trainer's data path: while the pool is busy with copies and flushes, wait
  // a little between pieces (the sender runs at nice 19, so it also gives way for the CPU).
  if (!hooks_.pool_used || hooks_.pool_bytes == 0) return;
  // 3 ms per 1 MiB piece caps the sender at about 350 MB/s while the pool is busy, and never
  // stops it (a flush-bound trainer keeps the pool busy all the time). A shorter wait lets
  // replication take the writers' share of the cores: at 1 ms a flush-bound trainer's stall
  // p50 doubled on 2 cores, at 3 ms it stays at R=0's (docs/BENCHMARKS.md, "Peer replication").
  static_assert(kReplicaPiece == 1 << 20, "the wait is per MiB");
  if (hooks_.pool_used() > hooks_.pool_bytes / 4) std::this_thread::sleep_for(std::chrono::milliseconds(3));
}

Status Replicator::SendTo(const std::string& peer, const std::shared_ptr<MemoryImage>& shard, std::uint64_t* held,
                          const DeltaPlan& delta) {
  const MemoryImage& image = *shard;
  auto channel = ChannelTo(peer);
  // A channel whose last attempt failed (the peer was down: a DropJob or a send found it so)
  // fails calls at once until its next reconnect, up to the 1 s backoff later: a peer that has
  // come back is given that long to be reached, rather than counted as failed. Once per
  // failure, not per shard: a send that failed in the last 10 s fails at once again (the
  // next daemon of the ring takes the shard), so a peer that stays down does not slow
  // every send by the wait.
  if (channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
    const auto now = std::chrono::steady_clock::now();
    bool wait = true;
    {
      MutexLock lock(mu_);
      auto it = send_failed_at_.find(peer);
      wait = it == send_failed_at_.end() || now - it->second > std::chrono::seconds(10);
    }
    if (wait) channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
  }
  grpc::ClientContext ctx;
  const std::string subject =
      PeerSecret::ShardSubject(image.meta.job, image.meta.version, image.meta.rank, peers_.self_address());
  const std::string token = secret_.Token("PutShard", PeerSecret::Addressed(subject, peer));
  const std::string nonce = PeerSecret::NonceOf(token);
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
  // At least 10 MB/s, and 30 s for anything.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30) +
                   std::chrono::milliseconds(image.file_bytes / 10000));
  v1::PutShardReply reply;
  const grpc::internal::RpcMethod method(kPutShardMethod, grpc::internal::RpcMethod::CLIENT_STREAMING);
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx, &reply));
  std::uint64_t sent = 0;
  // A receiver that stops taking pieces (or never replies) is given up.
  ProgressWatch watch(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  SendImage(shard, peers_.self_address(), kReplicaPiece, PieceSums::kChecked, secret_.StartImage(),
            PeerSecret::ImageBinding("PutShard", nonce, image.meta.job, image.meta.version, image.meta.rank,
                                     image.meta.session, peers_.self_address(), image.file_bytes,
                                     delta.base_version),
            [&](const grpc::ByteBuffer& piece, std::uint64_t n) {
              sent += n;
              const bool ok = writer->Write(piece);
              watch.Progress();
              return ok;
            },
            [this, &watch] {
              Pace();
              watch.Progress();  // the wait is this daemon's
            },
            delta);
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  if (watch.fired()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerStalled);
    st = grpc::Status(grpc::StatusCode::UNAVAILABLE, Stalled(peer, watch.limit()));
  }
  metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kSent, sent);
  {
    MutexLock lock(mu_);
    if (st.ok()) {
      send_failed_at_.erase(peer);
    } else {
      send_failed_at_[peer] = std::chrono::steady_clock::now();
    }
  }
  if (!st.ok()) return FromGrpc(st, "peer " + peer);
  // An acknowledgement counts only from a peer that proves it knows the secret: whatever
  // listens on its address could say OK.
  if (Status proven = secret_.CheckProof(ProofOf(ctx), "PutShard", nonce, PeerSecret::PutAnswer(subject, reply.bytes_held()));
      !proven.ok()) {
    return PermissionDenied("peer " + peer + ": " + Unproven(peer, proven).message());
  }
  *held = reply.bytes_held();
  return Status::Ok();
}

void Replicator::SendLoop() {
  // The lowest CPU priority, for this thread only (Linux: a thread's nice is its own).
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  for (;;) {
    std::shared_ptr<MemoryImage> image;
    ShardMeta m;
    {
      MutexLock lock(mu_);
      while (queue_.empty() && !stopping_) changed_.Wait(mu_);
      if (stopping_) return;
      m = queue_.front().meta;
      image = queue_.front().image.lock();
      queue_.pop_front();
    }
    const Key key{m.job, m.version, m.rank};
    if (!image) {
      Finish(key,
             FailedPrecondition(DescribeShard(m.job, m.version, m.rank) +
                                " left the memory tier before it was sent to its peers (a newer version replaced it)"),
             0);
      continue;
    }
    // The header's items, parsed once for every peer's delta (none if it does not parse:
    // the image then goes whole).
    std::vector<ItemSpan> items;
    std::uint64_t header_end = 0;
    if (auto header = ImageHeader(*image); header.ok()) {
      items = ItemSpans(header.value());
      header_end = header->data_start;
    }
    const std::uint32_t want = peers_.replicas;
    std::uint32_t acks = 0;
    std::string errors;
    // The rule's holders first, then the rest of the ring for any that could not take it.
    std::vector<std::size_t> order = peers_.Holders();
    for (std::size_t i : peers_.Ring()) {
      if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
    }
    for (std::size_t i : order) {
      if (acks == want) break;
      {
        MutexLock lock(mu_);
        if (stopping_) return;
      }
      const std::string& peer = peers_.addresses[i];
      std::uint64_t held = 0;
      Status st = SendShard(peer, image, items, header_end, &held);
      if (st.ok()) {
        ++acks;
        metrics::Metrics().Replication(metrics::ReplicationEvent::kSent);
        NoteAcknowledged(peer, key, held);
        MutexLock lock(mu_);
        peer_error_.erase(peer);
        continue;
      }
      metrics::Metrics().Replication(metrics::ReplicationEvent::kSendFailed);
      NoteError(peer, st.message());
      errors += (errors.empty() ? "" : "; ") + st.message();
      send_log_.Warn("replication: " + DescribeShard(m.job, m.version, m.rank) + " not kept by " + peer + ": " +
                     st.message());
      if (st.code() == StatusCode::kPermissionDenied) {
        // Refused (another secret, another release), or an answer without proof.
        if (hooks_.error) hooks_.error("replication: " + DescribeShard(m.job, m.version, m.rank) + " not kept: " + st.message());
      }
    }
    if (acks == want) {
      ++replicated_;
      // The claim that may make the version restorable is written by its own thread: a
      // slow persistent tier delays neither this shard's level nor the next shard's sending.
      if (hooks_.replicated) hooks_.replicated(m);
      Finish(key, Status::Ok(), acks);
    } else {
      ++failures_;
      const std::string msg = DescribeShard(m.job, m.version, m.rank) + " is held by " + std::to_string(acks) + " of " +
                              std::to_string(want) + " peers: " + errors;
      if (hooks_.error) hooks_.error("replication: " + msg);
      Finish(key, Unreachable(msg), acks);
    }
  }
}

Replicator::JobDropped Replicator::OnJobFinished(const std::string& job) {
  JobDropped out;
  for (std::size_t i : peers_.Ring()) {
    const std::string& peer = peers_.addresses[i];
    ++out.told;
    auto stub = v1::Peer::NewStub(ChannelTo(peer));
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::JobSubject(job, peers_.self_address());
    const std::string token = secret_.Token("DropJob", PeerSecret::Addressed(subject, peer));
    ctx.AddMetadata(PeerSecret::kMetadataKey, token);
    ctx.set_deadline(std::chrono::system_clock::now() + kHasDeadline);
    v1::DropJobRequest req;
    req.set_job(job);
    req.set_origin(peers_.self_address());
    v1::DropJobReply reply;
    grpc::Status st = stub->DropJob(&ctx, req, &reply);
    if (!st.ok()) {
      spdlog::info("replication: peer {} did not drop job {}'s replicas: {}", peer, job, st.error_message());
      continue;
    }
    if (Status proven =
            secret_.CheckProof(ProofOf(ctx), "DropJob", PeerSecret::NonceOf(token),
                               PeerSecret::DropAnswer(subject, reply.dropped(), reply.bytes_held()));
        !proven.ok()) {
      Unproven(peer, proven);
      continue;
    }
    ++out.dropped;
    NoteDropped(peer, job, reply.bytes_held());
  }
  // A peer that did not answer may still hold them, but no version of the job comes after.
  ForgetDeltaBases("", job, kAllRanks);
  return out;
}

std::vector<Replicator::PeerInfo> Replicator::Peers() {
  const auto held = memory_.ReplicaBytes();
  const auto rule = peers_.Holders();
  std::vector<PeerInfo> out;
  MutexLock lock(mu_);
  for (std::size_t i : peers_.Ring()) {
    PeerInfo p;
    p.address = peers_.addresses[i];
    if (auto it = held.find(p.address); it != held.end()) p.held_bytes = it->second;
    if (auto it = sent_held_.find(p.address); it != sent_held_.end()) {
      p.sent_bytes_held = it->second.bytes;
      p.sent_said_at = it->second.at;
    }
    if (auto it = peer_error_.find(p.address); it != peer_error_.end()) p.error = it->second;
    p.holder = std::find(rule.begin(), rule.end(), i) != rule.end();
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace ckpt
