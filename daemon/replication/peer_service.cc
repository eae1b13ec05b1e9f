#include "daemon/replication/peer_service.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <cstring>

#include "ckpt/v1/peer.grpc.pb.h"
#include "common/names.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replication/parity_store.h"
#include "daemon/replication/peer_protocol.h"
#include "daemon/replication/piece_wire.h"
#include "daemon/replication/shard_stream.h"
#include "daemon/base/throttled_log.h"
#include "format/checksum.h"
#include "proto/grpc_status.h"

namespace ckpt {
namespace {

// The pieces of the erasure calls' bytes.
constexpr std::uint64_t kErasurePiece = 4 << 20;

// The peer server's threads at most (the sync API runs each call on one): a call beyond is
// refused (RESOURCE_EXHAUSTED) rather than given a thread. A replacement node restoring
// every rank at once, and every peer sending to this one, stay far below it.
constexpr int kMaxServerThreads = 64;
// A peer connection without a call for this long is closed; a daemon's channel reconnects
// at its next call.
constexpr int kPeerIdleMs = 60'000;

// The gRPC status a Peer handler returns for `st`.
grpc::Status ToPeerGrpc(const Status& st) { return ToGrpc(st, GrpcService::kPeer); }

}  // namespace

// The Peer service: every call is checked against the shared secret first.
class PeerServiceImpl final : public v1::Peer::Service {
 public:
  PeerServiceImpl(MemoryTier& memory, ParityStore* parity, const PeerSecret& secret, std::string self_address)
      : memory_(memory),
        parity_(parity),
        secret_(secret),
        self_(std::move(self_address)),
        corrupt_replicas_([] {
          const char* e = std::getenv("CKPTD_TEST_CORRUPT_REPLICAS");
          return e != nullptr && std::string(e) == "1";
        }()) {
    // The two calls that carry shard bytes read and write their pieces as raw ByteBuffers
    // (piece_wire.h), through handlers of the same sync API as the generated ones; the
    // Service owns them. The indexes are the methods' order in peer.proto.
    MarkMethodStreamed(kPutShardMethodIndex,
                       new grpc::internal::ClientStreamingHandler<PeerServiceImpl, grpc::ByteBuffer, v1::PutShardReply>(
                           [](PeerServiceImpl* self, grpc::ServerContext* ctx,
                              grpc::ServerReader<grpc::ByteBuffer>* reader,
                              v1::PutShardReply* reply) { return self->ReceiveShard(ctx, reader, reply); },
                           this));
    MarkMethodStreamed(kGetShardMethodIndex,
                       new grpc::internal::SplitServerStreamingHandler<v1::GetShardRequest, grpc::ByteBuffer>(
                           [this](grpc::ServerContext* ctx,
                                  grpc::ServerSplitStreamer<v1::GetShardRequest, grpc::ByteBuffer>* stream) {
                             return ServeShard(ctx, stream);
                           }));
  }

  // PutShard.
  grpc::Status ReceiveShard(grpc::ServerContext* ctx, grpc::ServerReader<grpc::ByteBuffer>* reader,
                            v1::PutShardReply* reply) {
    // The token is bound to the shard and origin the sender names in metadata: checked
    // before anything is read (an unauthenticated stream costs no buffer), then the first
    // piece must be that shard from that origin.
    const auto& md = ctx->client_metadata();
    auto sub = md.find(PeerSecret::kSubjectKey);
    const std::string subject = sub == md.end() ? std::string() : std::string(sub->second.data(), sub->second.size());
    std::string nonce;
    if (Status st = Auth(ctx, "PutShard", subject, &nonce); !st.ok()) return Refuse(st);
    grpc::ByteBuffer buffer;
    if (!reader->Read(&buffer)) return ToPeerGrpc(DataLoss("PutShard: the stream ended before its first piece"));
    auto parsed = WirePiece::Parse(buffer);
    if (!parsed.ok()) return Refuse(parsed.status());
    const WirePiece head = std::move(parsed).value();
    const v1::ShardPiece& f = head.fields();
    if (PeerSecret::ShardSubject(f.key().job(), f.key().version(), f.key().rank(), f.origin()) != subject) {
      return Refuse(PermissionDenied("PutShard: the first piece is not the shard its token was made for (" + subject +
                                     ")"));
    }
    const std::string origin = f.origin();
    std::shared_ptr<MemoryImage> reserved;
    std::uint64_t base_held = 0;  // a delta's base, found: the image is made beside it
    auto make = [&](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) {
      bool own = false;
      // Beside a base held by the transfer, only the rank's older replicas give way (the base
      // they replace): a delta that does not fit so is refused, and the whole image follows.
      reserved = memory_.ReserveReplica(meta, file_bytes, origin.empty() ? "?" : origin, &own, base_held);
      if (!reserved && own) {
        *why = "this daemon holds its own shard of " + DescribeShard(meta.job, meta.version, meta.rank) +
               " (the rank ran here): a replica of it adds nothing";
      } else if (!reserved) {
        *why = "no room for " + DescribeShard(meta.job, meta.version, meta.rank) + " (" + std::to_string(file_bytes >> 20) +
               " MiB) in this daemon's memory tier without dropping its own shards (--memory-mib " +
               std::to_string(memory_.GetStats().budget >> 20) + ")";
      }
      return reserved;
    };
    // A delta's base: a replica of an older version of the same (job, rank) from the same
    // origin, never this daemon's own shard nor another sender's replica.
    auto find_base = [&](std::uint64_t base_version, std::string* why) {
      auto base = memory_.FindReplica(f.key().job(), base_version, f.key().rank(), origin);
      base_held = base != nullptr ? base_version : 0;
      if (!base) {
        *why = "this daemon holds no replica of " + DescribeShard(f.key().job(), base_version, f.key().rank()) +
               " from " + origin + " (dropped, or never kept)";
      }
      return base;
    };
    std::uint64_t received = 0;
    auto image = ReceiveImage(
        head, [&](grpc::ByteBuffer* b) { return reader->Read(b); }, make, v1::ShardKey(), PieceSums::kChecked,
        ImageCheck{&secret_, "PutShard", nonce, ""}, &received, find_base);
    metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kReceived, received);
    if (!image.ok()) {
      if (reserved) memory_.Drop(reserved);
      return Refuse(image.status().With("replica from " + origin));
    }
    std::shared_ptr<MemoryImage> img = std::move(image).value();
    if (corrupt_replicas_ && img->file_bytes > 0) img->data()[img->file_bytes - 1] ^= 0x5a;  // test seam
    memory_.Complete(img);
    metrics::Metrics().Replication(metrics::ReplicationEvent::kReceived);
    spdlog::debug("peer: keeping a replica of {} from {}", DescribeShard(img->meta.job, img->meta.version, img->meta.rank),
                  origin);
    const auto held = memory_.ReplicaBytes();
    auto it = held.find(origin);
    reply->set_bytes_held(it == held.end() ? 0 : it->second);
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             secret_.Proof("PutShard", nonce, PeerSecret::PutAnswer(subject, reply->bytes_held())));
    return grpc::Status::OK;
  }

  // GetShard.
  grpc::Status ServeShard(grpc::ServerContext* ctx,
                          grpc::ServerSplitStreamer<v1::GetShardRequest, grpc::ByteBuffer>* stream) {
    // Authenticated before the request is read: a stream that sends no token costs no wait
    // for a request that may never come. The token is bound to the subject in metadata, and
    // the request must ask for that shard.
    const auto& md = ctx->client_metadata();
    auto sub = md.find(PeerSecret::kSubjectKey);
    const std::string subject = sub == md.end() ? std::string() : std::string(sub->second.data(), sub->second.size());
    std::string nonce;
    if (Status st = Auth(ctx, "GetShard", subject, &nonce); !st.ok()) return Refuse(st);
    v1::GetShardRequest req;
    if (!stream->Read(&req)) return ToPeerGrpc(InvalidArgument("GetShard: no request"));
    if (KeySubject(req.key()) != subject) {
      return Refuse(PermissionDenied("GetShard: the request is not for the shard its token was made for (" + subject +
                                     ")"));
    }
    if (Status st = CheckShardKey(req.key()); !st.ok()) return ToPeerGrpc(st);
    auto image = memory_.Find(req.key().job(), req.key().version(), req.key().rank());
    if (!image) {
      return ToPeerGrpc(NotFound("no image of " +
                                 DescribeShard(req.key().job(), req.key().version(), req.key().rank()) +
                                 " in this daemon's memory"));
    }
    std::uint64_t sent = 0;
    const std::string binding =
        PeerSecret::ImageBinding("GetShard", nonce, image->meta.job, image->meta.version, image->meta.rank,
                                 image->meta.session, self_, image->file_bytes);
    bool ok = SendImage(image, self_, kFetchPiece, PieceSums::kNone, secret_.StartImage(), binding,
                        [&](const grpc::ByteBuffer& piece, std::uint64_t n) {
                          sent += n;
                          return stream->Write(piece);
                        },
                        nullptr);
    metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kServed, sent);
    return ok ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
  }

  grpc::Status HasShard(grpc::ServerContext* ctx, const v1::HasShardRequest* req, v1::HasShardReply* reply) override {
    std::string nonce;
    if (Status st = Auth(ctx, "HasShard", KeySubject(req->key()), &nonce); !st.ok()) return Refuse(st);
    if (Status st = CheckShardKey(req->key()); !st.ok()) return ToPeerGrpc(st);
    auto image = memory_.Find(req->key().job(), req->key().version(), req->key().rank());
    reply->set_held(image != nullptr);
    if (image) {
      reply->set_file_bytes(image->file_bytes);
      reply->set_registration(image->meta.session);
    }
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             secret_.Proof("HasShard", nonce, HasAnswer(KeySubject(req->key()), *reply)));
    return grpc::Status::OK;
  }

  grpc::Status DropNewer(grpc::ServerContext* ctx, const v1::DropNewerRequest* req,
                         v1::DropJobReply* reply) override {
    std::string nonce;
    if (Status st = Auth(ctx, "DropNewer", KeySubject(req->key()), &nonce); !st.ok()) return Refuse(st);
    if (Status st = CheckShardKey(req->key()); !st.ok()) return ToPeerGrpc(st);
    const auto& k = req->key();
    reply->set_dropped(memory_.DropNewerThan(k.job(), k.rank(), k.version()));
    if (reply->dropped() > 0) {
      spdlog::info("peer: job {} rank {} restored version {}: dropped {} image(s) of the versions above it", k.job(),
                   k.rank(), k.version(), reply->dropped());
    }
    ctx->AddTrailingMetadata(
        PeerSecret::kProofKey,
        secret_.Proof("DropNewer", nonce, PeerSecret::DropAnswer(KeySubject(k), reply->dropped(), 0)));
    return grpc::Status::OK;
  }

  grpc::Status DropJob(grpc::ServerContext* ctx, const v1::DropJobRequest* req, v1::DropJobReply* reply) override {
    const std::string subject = PeerSecret::JobSubject(req->job(), req->origin());
    std::string nonce;
    if (Status st = Auth(ctx, "DropJob", subject, &nonce); !st.ok()) return Refuse(st);
    if (std::string why = CheckJobId(req->job()); !why.empty()) return ToPeerGrpc(InvalidArgument(why));
    if (req->origin().empty()) return ToPeerGrpc(InvalidArgument("DropJob needs its origin"));
    reply->set_dropped(memory_.DropReplicas(req->job(), req->origin()));
    if (reply->dropped() > 0) {
      spdlog::info("peer: job {} ended on {}: dropped {} replica(s)", req->job(), req->origin(), reply->dropped());
    }
    // What is left of the origin's replicas (its other jobs'): the origin's count of what this
    // daemon holds for it follows this, not zero.
    const auto held = memory_.ReplicaBytes();
    auto left = held.find(req->origin());
    reply->set_bytes_held(left == held.end() ? 0 : left->second);
    ctx->AddTrailingMetadata(
        PeerSecret::kProofKey,
        secret_.Proof("DropJob", nonce,
                      PeerSecret::DropAnswer(subject, reply->dropped(), reply->bytes_held())));
    return grpc::Status::OK;
  }

  grpc::Status ListReplicas(grpc::ServerContext* ctx, const v1::ListReplicasRequest* req,
                            v1::ListReplicasReply* reply) override {
    const std::string subject = PeerSecret::JobSubject(req->job(), req->origin());
    std::string nonce;
    if (Status st = Auth(ctx, "ListReplicas", subject, &nonce); !st.ok()) return Refuse(st);
    if (std::string why = CheckJobId(req->job()); !why.empty()) return ToPeerGrpc(InvalidArgument(why));
    if (req->origin().empty()) return ToPeerGrpc(InvalidArgument("ListReplicas needs its origin"));
    for (const auto& r : memory_.ReplicasFrom(req->job(), req->origin())) {
      auto* out = reply->add_replicas();
      out->mutable_key()->set_job(req->job());
      out->mutable_key()->set_version(r.version);
      out->mutable_key()->set_rank(r.rank);
      out->set_file_bytes(r.file_bytes);
    }
    ctx->AddTrailingMetadata(PeerSecret::kProofKey, secret_.Proof("ListReplicas", nonce, ListAnswer(subject, *reply)));
    return grpc::Status::OK;
  }

  // PutChunk: one data chunk of a group member's shard, folded into this daemon's parity.
  grpc::Status PutChunk(grpc::ServerContext* ctx, grpc::ServerReader<v1::ChunkPiece>* reader,
                        v1::PutChunkReply* reply) override {
    // The subject comes in metadata and is authenticated before a byte of the stream is read;
    // the first piece must then name the same chunk.
    const auto& md = ctx->client_metadata();
    auto said = md.find(PeerSecret::kSubjectKey);
    const std::string subject = said == md.end() ? std::string() : std::string(said->second.data(), said->second.size());
    std::string nonce;
    if (Status st = Auth(ctx, "PutChunk", subject, &nonce); !st.ok()) return Refuse(st);
    v1::ChunkPiece piece;
    if (!reader->Read(&piece)) return ToPeerGrpc(InvalidArgument("PutChunk: no piece"));
    const v1::StripeMember member = piece.member();
    if (PeerSecret::ShardSubject(member.job(), member.version(), member.rank(), member.origin()) != subject) {
      return Refuse(PermissionDenied("PutChunk: the first piece names another chunk than the call's token"));
    }
    if (parity_ == nullptr) {
      return ToPeerGrpc(FailedPrecondition("this daemon holds no parity (it runs without --erasure)"));
    }
    if (std::string why = CheckJobId(member.job()); !why.empty()) return ToPeerGrpc(InvalidArgument(why));
    if (member.chunk_bytes() == 0 || member.chunk_bytes() > kMaxErasureChunkBytes) {
      return ToPeerGrpc(InvalidArgument("PutChunk: a chunk of " + std::to_string(member.chunk_bytes()) +
                                        " bytes (1 to " + std::to_string(kMaxErasureChunkBytes) + " taken)"));
    }
    std::vector<std::uint8_t> chunk(member.chunk_bytes(), 0);
    PeerSecret::ImageMac mac = secret_.StartImage();
    std::uint64_t at = 0;
    for (;;) {
      if (piece.offset() != at || piece.data().size() > chunk.size() - at) {
        return ToPeerGrpc(DataLoss("PutChunk: a piece at " + std::to_string(piece.offset()) + " of " +
                                   std::to_string(piece.data().size()) + " bytes, expected one at " +
                                   std::to_string(at) + " inside the chunk"));
      }
      std::memcpy(chunk.data() + at, piece.data().data(), piece.data().size());
      mac.Update(piece.data().data(), piece.data().size());
      at += piece.data().size();
      if (piece.last()) break;
      if (!reader->Read(&piece)) return ToPeerGrpc(DataLoss("PutChunk: the stream ended before its last piece"));
    }
    if (!PeerSecret::SameMac(mac.Finish(ChunkBinding("PutChunk", nonce, member)), piece.mac())) {
      return Refuse(PermissionDenied("PutChunk: the chunk's MAC does not match (not sent by a daemon of the cluster)"));
    }
    if (Checksum::Of(chunk.data(), chunk.size()) != member.chunk_xxh3()) {
      return ToPeerGrpc(DataLoss("PutChunk: the chunk does not match its checksum"));
    }
    if (Status st = parity_->Fold(member, chunk.data()); !st.ok()) return ToPeerGrpc(st);
    reply->set_parity_bytes_held(parity_->parity_bytes());
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             secret_.Proof("PutChunk", nonce, ChunkBinding("PutChunk", nonce, member)));
    return grpc::Status::OK;
  }

  // GetParity: the parity this daemon holds for the stripe, and its members.
  grpc::Status GetParity(grpc::ServerContext* ctx, const v1::GetParityRequest* req,
                         grpc::ServerWriter<v1::ParityPiece>* writer) override {
    const std::string subject = PeerSecret::ShardSubject(req->job(), req->version(), req->rank(), req->origin());
    std::string nonce;
    if (Status st = Auth(ctx, "GetParity", subject, &nonce); !st.ok()) return Refuse(st);
    if (parity_ == nullptr) return ToPeerGrpc(NotFound("this daemon holds no parity (it runs without --erasure)"));
    auto held = parity_->Find(req->job(), req->version(), req->stripe(), req->origin(), req->rank());
    if (!held) {
      return ToPeerGrpc(NotFound("no parity of stripe " + std::to_string(req->stripe()) + " of " +
                                 DescribeShard(req->job(), req->version(), req->rank()) + " from " + req->origin()));
    }
    v1::ParityPiece first;
    for (const auto& m : held->members) *first.add_members() = m;
    first.set_row(held->row);
    first.set_parity_bytes(held->parity->size());
    first.set_parity_xxh3(held->parity_xxh3);
    const std::string binding = ParityBinding(nonce, first);
    PeerSecret::ImageMac mac = secret_.StartImage();
    const std::vector<std::uint8_t>& bytes = *held->parity;
    std::uint64_t at = 0;
    v1::ParityPiece piece = first;
    do {
      const std::uint64_t n = std::min<std::uint64_t>(kErasurePiece, bytes.size() - at);
      piece.set_offset(at);
      piece.set_data(reinterpret_cast<const char*>(bytes.data()) + at, n);
      if (at == 0 && n > 0 && parity_->corrupt_for_tests()) (*piece.mutable_data())[0] ^= 0x5a;
      mac.Update(piece.data().data(), piece.data().size());
      at += n;
      if (at == bytes.size()) {
        piece.set_last(true);
        piece.set_mac(mac.Finish(binding));
      }
      if (!writer->Write(piece)) return grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
      piece.Clear();
    } while (at < bytes.size());
    return grpc::Status::OK;
  }

  // GetChunk: a byte range of a shard image held here, for a rebuild on another daemon.
  grpc::Status GetChunk(grpc::ServerContext* ctx, const v1::GetChunkRequest* req,
                        grpc::ServerWriter<v1::ChunkPiece>* writer) override {
    std::string nonce;
    if (Status st = Auth(ctx, "GetChunk", KeySubject(req->key()), &nonce); !st.ok()) return Refuse(st);
    if (Status st = CheckShardKey(req->key()); !st.ok()) return ToPeerGrpc(st);
    const auto& k = req->key();
    auto image = memory_.Find(k.job(), k.version(), k.rank());
    if (!image || !image->complete) return ToPeerGrpc(NotFound(DescribeShard(k.job(), k.version(), k.rank()) + " is not held here"));
    if (req->offset() > image->file_bytes || req->length() > image->file_bytes - req->offset()) {
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "the range is not inside the image");
    }
    const std::string binding = RangeBinding(nonce, k.job(), k.version(), k.rank(), req->offset(), req->length());
    PeerSecret::ImageMac mac = secret_.StartImage();
    std::uint64_t at = 0;
    v1::ChunkPiece piece;
    do {
      const std::uint64_t n = std::min<std::uint64_t>(kErasurePiece, req->length() - at);
      piece.set_offset(req->offset() + at);
      piece.set_data(image->data() + req->offset() + at, n);
      mac.Update(piece.data().data(), piece.data().size());
      at += n;
      if (at == req->length()) {
        piece.set_last(true);
        piece.set_mac(mac.Finish(binding));
      }
      if (!writer->Write(piece)) return grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
      piece.Clear();
    } while (at < req->length());
    metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kServed, req->length());
    return grpc::Status::OK;
  }

  grpc::Status DropParity(grpc::ServerContext* ctx, const v1::DropParityRequest* req,
                          v1::DropJobReply* reply) override {
    const std::string subject = PeerSecret::JobSubject(req->job(), "");
    std::string nonce;
    if (Status st = Auth(ctx, "DropParity", subject, &nonce); !st.ok()) return Refuse(st);
    if (std::string why = CheckJobId(req->job()); !why.empty()) return ToPeerGrpc(InvalidArgument(why));
    reply->set_dropped(parity_ ? parity_->Drop(req->job(), req->version(), req->drop_all()) : 0);
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             secret_.Proof("DropParity", nonce, PeerSecret::DropAnswer(subject, reply->dropped(), 0)));
    return grpc::Status::OK;
  }

 private:
  static std::string KeySubject(const v1::ShardKey& k) {
    return PeerSecret::ShardSubject(k.job(), k.version(), k.rank(), "");
  }
  // Checks the caller's token; *nonce: its nonce, which the reply's proof is bound to.
  Status Auth(grpc::ServerContext* ctx, const std::string& call, const std::string& subject, std::string* nonce) {
    const auto& md = ctx->client_metadata();
    auto it = md.find(PeerSecret::kMetadataKey);
    const std::string token = it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
    // The token names this daemon too: one made for another daemon (relayed by whatever
    // was on its address) is refused.
    Status st = secret_.Check(token, call, PeerSecret::Addressed(subject, self_));
    if (!st.ok()) {
      refused_log_.Warn("peer: refused a call from " + ctx->peer() + ": " + st.message());
      return st;
    }
    *nonce = PeerSecret::NonceOf(token);
    return st;
  }
  grpc::Status Refuse(const Status& st) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kRefused);
    return ToPeerGrpc(st);
  }
  MemoryTier& memory_;
  ParityStore* const parity_;  // null without --erasure
  const PeerSecret& secret_;
  const std::string self_;       // this daemon's address in --peers
  const bool corrupt_replicas_;  // test seam: CKPTD_TEST_CORRUPT_REPLICAS=1
  ThrottledLog refused_log_;     // refused calls, at most one line a second
};

Result<std::unique_ptr<PeerServer>> PeerServer::Start(const std::string& listen, PeerAcceptor::Limits limits,
                                                      MemoryTier& memory, ParityStore* parity,
                                                      const PeerSecret& secret, std::string self_address) {
  std::unique_ptr<PeerServer> s(new PeerServer());
  s->service_ = std::make_unique<PeerServiceImpl>(memory, parity, secret, std::move(self_address));
  grpc::ServerBuilder builder;
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(kMaxPeerMessage);
  builder.SetMaxSendMessageSize(kMaxPeerMessage);
  grpc::ResourceQuota quota("ckptd-peer");
  quota.SetMaxThreads(kMaxServerThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kPeerIdleMs);
  // No listening port of gRPC's own: the acceptor below takes the connections, within its
  // limits, and hands them over.
  s->server_ = builder.BuildAndStart();
  if (!s->server_) return Unreachable("--peer-listen " + listen + ": cannot start the peer server");
  auto acceptor = PeerAcceptor::Start(listen, limits, [server = s->server_.get()](int fd) {
    grpc::AddInsecureChannelFromFd(server, fd);
  });
  if (!acceptor.ok()) {
    s->server_->Shutdown();
    s->server_.reset();
    return acceptor.status().code() == StatusCode::kInvalidArgument
               ? acceptor.status()
               : Unreachable(acceptor.status().message() + " (address in use or not this host's)");
  }
  s->acceptor_ = std::move(acceptor).value();
  s->bound_ = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(s->acceptor_->port());
  return s;
}

PeerServer::~PeerServer() {
  acceptor_.reset();  // before the server its thread hands connections to
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
}

}  // namespace ckpt
