// Replicator's restore side (PeerShards): which peers hold a shard, fetching one back, and
// dropping the versions a restore went behind. The sender is in replicator.cc.
#include "daemon/replication/replicator.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>

#include "ckpt/v1/peer.grpc.pb.h"
#include "common/align.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replication/erasure_group.h"
#include "daemon/replication/peer_protocol.h"
#include "daemon/replication/progress_watch.h"
#include "daemon/replication/shard_stream.h"
#include "proto/grpc_status.h"

namespace ckpt {

std::shared_ptr<MemoryImage> StandaloneImage(const ShardMeta& meta, std::uint64_t file_bytes) {
  const std::uint64_t cap = AlignUp(std::max<std::uint64_t>(file_bytes, 1), 4096);
  // Plain 4 KiB pages, faulted in by the copy. Measured on the 2-core VM (DESIGN-NOTES,
  // "Peer replication of the memory tier", "Measured"): MAP_POPULATE, a thread faulting the
  // pages in ahead of the copy, and transparent huge pages were all slower (huge pages by
  // seconds, in compaction).
  void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::shared_ptr<MemoryImage>(new MemoryImage(meta, file_bytes, static_cast<char*>(p), cap),
                                      [](MemoryImage* img) {
                                        ::munmap(img->data(), img->capacity());
                                        delete img;
                                      });
}

grpc::Status Replicator::AskHasShard(const std::string& peer, const std::string& job, std::uint64_t version,
                                     std::uint32_t rank, v1::HasShardReply* reply) {
  auto stub = v1::Peer::NewStub(ChannelTo(peer));
  grpc::ClientContext ctx;
  const std::string subject = PeerSecret::ShardSubject(job, version, rank, "");
  const std::string token = secret_.Token("HasShard", PeerSecret::Addressed(subject, peer));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.set_deadline(std::chrono::system_clock::now() + kHasDeadline);
  v1::HasShardRequest req;
  req.mutable_key()->set_job(job);
  req.mutable_key()->set_version(version);
  req.mutable_key()->set_rank(rank);
  grpc::Status st = stub->HasShard(&ctx, req, reply);
  if (!st.ok()) return st;
  if (Status proven =
          secret_.CheckProof(ProofOf(ctx), "HasShard", PeerSecret::NonceOf(token), HasAnswer(subject, *reply));
      !proven.ok()) {
    reply->Clear();
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, Unproven(peer, proven).message());
  }
  return st;
}

std::vector<std::string> Replicator::Holding(const std::string& job, std::uint64_t version, std::uint32_t rank) {
  std::vector<std::string> out;
  const auto rule = peers_.Holders();
  for (std::size_t i : peers_.Ring()) {
    const std::string& peer = peers_.addresses[i];
    v1::HasShardReply reply;
    grpc::Status st = AskHasShard(peer, job, version, rank, &reply);
    const bool by_rule = std::find(rule.begin(), rule.end(), i) != rule.end();
    if (st.ok() && reply.held()) {
      out.push_back(peer);
      continue;
    }
    const bool unproven = st.error_code() == grpc::StatusCode::UNAUTHENTICATED;
    if (by_rule || unproven) {
      // A holder by the rule that cannot serve, or any peer whose answer proves nothing: the
      // restore goes on to the next one.
      metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
      const std::string why = st.ok()    ? "holds no replica"
                              : unproven ? st.error_message()
                                         : "unreachable (" + st.error_message() + ")";
      if (hooks_.error) {
        hooks_.error("restore of " + DescribeShard(job, version, rank) + ": peer " + peer +
                     (by_rule ? " (a holder by the peer rule) " : " ") + why + "; trying the next replica");
      }
      NoteError(peer, why);
    }
  }
  if (erasure_ != nullptr) out.push_back(ErasureGroup::kSource);
  return out;
}

bool Replicator::RecentlySilent(const std::string& peer) {
  // A peer that did not answer a moment ago (a lost node) is not asked again for every rank
  // of a version: each ask could cost the whole deadline.
  MutexLock lock(mu_);
  auto it = has_failed_at_.find(peer);
  return it != has_failed_at_.end() && std::chrono::steady_clock::now() - it->second < kSilentFor;
}

void Replicator::NoteAnswer(const std::string& peer, bool answered) {
  MutexLock lock(mu_);
  if (answered) {
    has_failed_at_.erase(peer);
  } else {
    has_failed_at_[peer] = std::chrono::steady_clock::now();
  }
}

bool Replicator::AnyHolds(const std::string& job, std::uint64_t version, std::uint32_t rank,
                          const std::string& registration) {
  for (std::size_t i : peers_.Ring()) {
    const std::string& peer = peers_.addresses[i];
    if (RecentlySilent(peer)) continue;
    v1::HasShardReply reply;
    grpc::Status st = AskHasShard(peer, job, version, rank, &reply);
    NoteAnswer(peer, st.ok());
    if (st.ok() && reply.held() && reply.registration() == registration) return true;
  }
  return false;
}

void Replicator::DropNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) {
  ForgetNewer(job, rank, version);
  if (erasure_ != nullptr) erasure_->DropNewer(job, rank, version);
  for (std::size_t i : peers_.Ring()) {
    const std::string& peer = peers_.addresses[i];
    if (RecentlySilent(peer)) continue;  // a lost node: its memory is gone with it
    auto stub = v1::Peer::NewStub(ChannelTo(peer));
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::ShardSubject(job, version, rank, "");
    const std::string token = secret_.Token("DropNewer", PeerSecret::Addressed(subject, peer));
    ctx.AddMetadata(PeerSecret::kMetadataKey, token);
    ctx.set_deadline(std::chrono::system_clock::now() + kHasDeadline);
    v1::DropNewerRequest req;
    req.mutable_key()->set_job(job);
    req.mutable_key()->set_version(version);
    req.mutable_key()->set_rank(rank);
    v1::DropJobReply reply;
    grpc::Status st = stub->DropNewer(&ctx, req, &reply);
    if (st.ok()) {
      if (Status proven = secret_.CheckProof(ProofOf(ctx), "DropNewer", PeerSecret::NonceOf(token),
                                             PeerSecret::DropAnswer(subject, reply.dropped(), 0));
          !proven.ok()) {
        st = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, Unproven(peer, proven).message());
      }
    }
    NoteAnswer(peer, st.ok());
    if (!st.ok()) {
      spdlog::info("replication: peer {} did not drop rank {} of job {} above version {}: {}", peer, rank, job,
                   version, st.error_message());
    }
  }
}

Result<std::shared_ptr<MemoryImage>> Replicator::Fetch(const std::string& peer, const std::string& job,
                                                       std::uint64_t version, std::uint32_t rank) {
  if (erasure_ != nullptr && peer == ErasureGroup::kSource) return erasure_->Rebuild(job, version, rank);
  return FetchWith(peer, job, version, rank, FetchOptions{});
}

Result<std::vector<Replicator::ReplicaHeld>> Replicator::ReplicasSentFrom(const std::string& peer,
                                                                          const std::string& job) {
  auto stub = v1::Peer::NewStub(ChannelTo(peer));
  grpc::ClientContext ctx;
  const std::string subject = PeerSecret::JobSubject(job, peers_.self_address());
  const std::string token = secret_.Token("ListReplicas", PeerSecret::Addressed(subject, peer));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.set_deadline(std::chrono::system_clock::now() + kHasDeadline);
  v1::ListReplicasRequest req;
  req.set_job(job);
  req.set_origin(peers_.self_address());
  v1::ListReplicasReply reply;
  grpc::Status st = stub->ListReplicas(&ctx, req, &reply);
  if (!st.ok()) return FromGrpc(st, "ask peer " + peer + " which replicas of job " + job + " it holds");
  if (Status proven =
          secret_.CheckProof(ProofOf(ctx), "ListReplicas", PeerSecret::NonceOf(token), ListAnswer(subject, reply));
      !proven.ok()) {
    return Unproven(peer, proven);
  }
  std::vector<ReplicaHeld> out;
  for (const auto& r : reply.replicas()) {
    if (r.key().job() != job) continue;
    out.push_back({r.key().version(), r.key().rank(), r.file_bytes()});
  }
  return out;
}

Result<std::shared_ptr<MemoryImage>> Replicator::FetchWith(const std::string& peer, const std::string& job,
                                                           std::uint64_t version, std::uint32_t rank,
                                                           const FetchOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto channel = ChannelTo(peer);
  grpc::ClientContext ctx;
  const std::string subject = PeerSecret::ShardSubject(job, version, rank, "");
  const std::string token = secret_.Token("GetShard", PeerSecret::Addressed(subject, peer));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  v1::GetShardRequest req;
  req.mutable_key()->set_job(job);
  req.mutable_key()->set_version(version);
  req.mutable_key()->set_rank(rank);
  const grpc::internal::RpcMethod method(kGetShardMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx, req));
  MakeImage make = options.make ? options.make : [](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) {
    auto img = StandaloneImage(meta, file_bytes);
    if (!img) *why = "cannot map " + std::to_string(file_bytes) + " bytes for the fetched shard";
    return img;
  };
  std::uint64_t received = 0;
  bool ended = false;  // the stream ended (the server's status is what to report)
  // A peer that stops sending is given up: the restore goes on with the next source.
  ProgressWatch watch(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  std::uint64_t reported = 0;  // of `received`, to options.on_piece
  auto report = [&] {
    if (options.on_piece && received > reported) {
      options.on_piece(received - reported);  // may sleep (pacing)
      reported = received;
    }
  };
  auto next = [&](grpc::ByteBuffer* b) {
    if (options.on_piece && received > reported) {
      report();          // the pieces received so far are in the image
      watch.Progress();  // a pause of the pacing is not the peer's stall
    }
    if (options.cancel != nullptr && options.cancel->load()) ctx.TryCancel();
    ended = ended || !reader->Read(b);
    if (!ended) watch.Progress();
    return !ended;
  };
  Result<std::shared_ptr<MemoryImage>> image = DataLoss("the stream ended before its first piece");
  if (grpc::ByteBuffer buffer; next(&buffer)) {
    auto first = WirePiece::Parse(buffer);
    image = first.ok() ? ReceiveImage(first.value(), next, make, req.key(), PieceSums::kNone,
                                      ImageCheck{&secret_, "GetShard", PeerSecret::NonceOf(token), peer}, &received)
                       : Result<std::shared_ptr<MemoryImage>>(first.status());
  }
  report();
  if (!options.make) metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kFetched, received);
  if (!image.ok() && image.status().code() == StatusCode::kPermissionDenied) {
    image = Unproven(peer, image.status());
  }
  if (!image.ok() && !ended) {
    // A bad piece: the rest is not read, and a call with pieces left unread would not finish
    // (the server waits for flow control) before its deadline. Cancelled; the piece's error
    // is the reason.
    ctx.TryCancel();
    reader->Finish();
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    return image.status();
  }
  grpc::Status st = reader->Finish();
  if (watch.fired()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerStalled);
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    const std::string m = "fetch " + DescribeShard(job, version, rank) + ": " + Stalled(peer, watch.limit());
    unproven_log_.Warn("replication: " + m);
    return Unreachable(m);
  }
  if (!st.ok()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    return FromGrpc(st, "fetch " + DescribeShard(job, version, rank));
  }
  if (!image.ok()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    return image.status();
  }
  // An image in a buffer of the caller's own (the warm start's, reserved in the memory tier)
  // is complete only once the caller has verified it: until then no restore nor peer may
  // take it (MemoryTier::Complete).
  if (!options.make) image.value()->complete = true;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("replication: fetched {} from peer {}: {} bytes in {:.0f} ms", DescribeShard(job, version, rank), peer,
               received, ms);
  return image;
}

}  // namespace ckpt
