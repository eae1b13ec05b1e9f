#include "daemon/replication/replicator.h"
#include "common/align.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "ckpt/v1/peer.grpc.pb.h"
#include "common/names.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replication/piece_wire.h"
#include "daemon/replication/progress_watch.h"
#include "format/checksum.h"
#include "format/shard_format.h"

namespace ckpt {
namespace {

// Bytes per streamed piece. A restore's fetch (GetShard) takes 4 MiB: a quarter of the
// per-piece work (a gRPC message, a flow-control round) for the same bytes. Replication
// (PutShard) keeps 1 MiB: the sender checks the trainer's pool before every piece, and
// gives way sooner between small ones.
constexpr std::uint64_t kPiece = std::uint64_t{4} << 20;
constexpr std::uint64_t kReplicaPiece = std::uint64_t{1} << 20;
constexpr std::uint64_t kMaxHeader = 64ull << 20;    // largest shard header accepted
constexpr std::size_t kStatesKept = 8192;            // replication states remembered
// The largest piece is the first, which holds the whole header (up to kMaxHeader + 8) or
// kPiece bytes; 1 MiB above that leaves room for the other fields.
constexpr int kMaxMessage = static_cast<int>(std::max(kMaxHeader + 8, kPiece) + (1 << 20));
// PutShard and GetShard by hand (their pieces are raw ByteBuffers, piece_wire.h): their
// full names and their indexes in the generated Service, as peer.proto declares them.
constexpr char kPutShardMethod[] = "/ckpt.v1.Peer/PutShard";
constexpr char kGetShardMethod[] = "/ckpt.v1.Peer/GetShard";
constexpr int kPutShardMethodIndex = 0;
constexpr int kGetShardMethodIndex = 1;
constexpr std::chrono::seconds kHasDeadline{3};
// The peer server's threads at most (the sync API runs each call on one): a call beyond is
// refused (RESOURCE_EXHAUSTED) rather than given a thread. A replacement node restoring
// every rank at once, and every peer sending to this one, stay far below it.
constexpr int kMaxServerThreads = 64;
// A peer connection without a call for this long is closed; a daemon's channel reconnects
// at its next call.
constexpr int kPeerIdleMs = 60'000;

// A peer that could not be reached or failed otherwise.
Status Unreachable(std::string m) { return {StatusCode::kIoError, std::move(m)}; }

std::string Stalled(const std::string& peer, std::chrono::milliseconds limit) {
  return "peer " + peer + " moved no byte for " + std::to_string(limit.count() / 1000) +
         " s (--peer-progress-timeout-s): given up";
}

std::string Describe(const std::string& job, std::uint64_t version, std::uint32_t rank) {
  return "job " + job + " version " + std::to_string(version) + " rank " + std::to_string(rank);
}

// The 8-byte little-endian prefix of a safetensors file: the header's length.
std::uint64_t HeaderEnd(const char* data, std::uint64_t file_bytes) {
  if (file_bytes < 8) return file_bytes;
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[i]);
  return n > file_bytes - 8 ? file_bytes : 8 + n;
}

// A buffer outside the memory tier's budget, for a fetched image that is only restored.
std::shared_ptr<MemoryImage> StandaloneImage(const ShardMeta& meta, std::uint64_t file_bytes) {
  const std::uint64_t cap = AlignUp(std::max<std::uint64_t>(file_bytes, 1), 4096);
  // Plain 4 KiB pages, faulted in by the copy. Measured on the 2-core VM (DESIGN-NOTES,
  // issue 17, "Measured"): MAP_POPULATE, a thread faulting the pages in ahead of the copy,
  // and transparent huge pages were all slower (huge pages by seconds, in compaction).
  void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::shared_ptr<MemoryImage>(new MemoryImage(meta, file_bytes, static_cast<char*>(p), cap),
                                      [](MemoryImage* img) {
                                        ::munmap(img->data(), img->capacity());
                                        delete img;
                                      });
}

grpc::Status ToGrpc(const Status& st) {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (st.code()) {
    case StatusCode::kOk:
      return grpc::Status::OK;
    case StatusCode::kInvalidArgument:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case StatusCode::kNotFound:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case StatusCode::kResourceExhausted:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case StatusCode::kPermissionDenied:
      code = grpc::StatusCode::UNAUTHENTICATED;
      break;
    case StatusCode::kDataLoss:
      code = grpc::StatusCode::DATA_LOSS;
      break;
    default:
      code = grpc::StatusCode::INTERNAL;
  }
  return grpc::Status(code, st.message());
}

Status FromGrpc(const grpc::Status& st, const std::string& what) {
  if (st.ok()) return Status::Ok();
  const std::string m = what + ": " + st.error_message();
  switch (st.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
      return NotFound(m);
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return ResourceExhausted(m);
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return PermissionDenied(m);
    case grpc::StatusCode::DATA_LOSS:
      return DataLoss(m);
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return DeadlineExceeded(m);
    default:
      return Unreachable(m);
  }
}

Status CheckKey(const v1::ShardKey& key) {
  if (std::string why = CheckJobId(key.job()); !why.empty()) return InvalidArgument(why);
  if (key.version() == 0) return InvalidArgument("version 0 is not a version");
  return Status::Ok();
}

// How the pieces of a transfer are checked on arrival. A replica (PutShard) is kept, and
// counts, only once every piece matched the xxh3-64 the sender took of it. An image fetched
// for a restore (GetShard) carries no piece checksums: its header is parsed and checked here
// (ParseShardHeader verifies ckpt.header_xxh3), and the restore then verifies every item it
// reads against the header's item (or block) checksums before any byte reaches a region,
// which covers every byte of the data section; a third pass over the same bytes would only
// repeat it.
enum class PieceSums { kChecked, kNone };

// What the MAC on an image's last piece must be made with (PeerSecret::ImageBinding): the
// receiver's secret, the call and the nonce of its token, and the node that should be
// sending it (empty: the one the first piece names, which the token bound).
struct ImageCheck {
  const PeerSecret* secret = nullptr;
  std::string call, nonce, origin;
};

// What a HasShard reply says, as its proof is bound to it.
std::string HasAnswer(const std::string& subject, const v1::HasShardReply& r) {
  return PeerSecret::HasAnswer(subject, r.held(), r.file_bytes(), r.registration());
}

// The proof a reply carried (trailing metadata), or "".
std::string ProofOf(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(PeerSecret::kProofKey);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

// The received pieces from `next` as a shard image, made once the first piece (with the
// whole header) is there: `make` gives it (null: refused, *refusal says why). `first` is the
// first piece, already read. Checks the pieces' order and sizes, the header (against
// `want` when it names a shard), with PieceSums::kChecked every piece's checksum, and the
// image's MAC as `check` says: PermissionDenied if it is not right, and the image is not
// returned (no byte of it is used).
template <typename Next, typename Make>
Result<std::shared_ptr<MemoryImage>> ReceiveImage(const WirePiece& first, Next next, Make make,
                                                  const v1::ShardKey& want, PieceSums sums,
                                                  const ImageCheck& check, std::uint64_t* received) {
  const v1::ShardPiece& head = first.fields();
  const v1::ShardKey key = head.has_key() ? head.key() : want;
  if (Status st = CheckKey(key); !st.ok()) return st;
  if (want.job() != "" && (key.job() != want.job() || key.version() != want.version() || key.rank() != want.rank())) {
    return DataLoss("the peer sent " + Describe(key.job(), key.version(), key.rank()) + ", not the shard asked for");
  }
  const std::uint64_t file_bytes = head.file_bytes();
  if (head.offset() != 0 || first.data_bytes() < 8 || first.data_bytes() > file_bytes) {
    return DataLoss("the first piece does not start the file");
  }
  if (!check.origin.empty() && head.origin() != check.origin) {
    return PermissionDenied("the shard was sent as coming from '" + head.origin() + "', not from the peer asked (" +
                            check.origin + ")");
  }
  PeerSecret::ImageMac mac = check.secret->StartImage();
  // The first piece is read into a buffer of its own: the image is made from its header.
  std::string data(first.data_bytes(), '\0');
  {
    Checksum sum;
    first.CopyData(data.data(), sums == PieceSums::kChecked ? &sum : nullptr, &mac);
    if (sums == PieceSums::kChecked && sum.Digest() != head.piece_xxh3()) {
      return DataLoss("the piece at offset 0 failed its checksum on arrival");
    }
  }
  const std::uint64_t header_end = HeaderEnd(data.data(), file_bytes);
  if (header_end - 8 > kMaxHeader || data.size() < header_end) {
    return DataLoss("the first piece does not hold the whole shard header");
  }
  auto info = ParseShardHeader(std::string_view(data.data() + 8, header_end - 8), file_bytes);
  if (!info.ok()) return info.status().With("the replica's header");
  const ShardMeta& meta = info->meta;
  if (meta.job != key.job() || meta.version != key.version() || meta.rank != key.rank()) {
    return DataLoss("the replica's header holds " + Describe(meta.job, meta.version, meta.rank) + ", not " +
                    Describe(key.job(), key.version(), key.rank()));
  }
  std::string refusal;
  std::shared_ptr<MemoryImage> image = make(meta, file_bytes, &refusal);
  if (!image) return ResourceExhausted(refusal);
  std::memcpy(image->data(), data.data(), data.size());
  std::uint64_t done = data.size();
  if (received) *received += done;
  bool last = head.last();
  std::string mac_sent = head.image_mac();
  while (!last) {
    grpc::ByteBuffer buffer;
    if (!next(&buffer)) break;
    auto parsed = WirePiece::Parse(buffer);
    if (!parsed.ok()) return parsed.status();
    const WirePiece& piece = parsed.value();
    const std::uint64_t n = piece.data_bytes();
    if (piece.fields().offset() != done || n > file_bytes - done) {
      return DataLoss("piece at offset " + std::to_string(piece.fields().offset()) + " (" + std::to_string(n) +
                      " bytes) does not follow byte " + std::to_string(done) + " of " + std::to_string(file_bytes));
    }
    // Straight into the image: the one copy of these bytes on this side.
    Checksum sum;
    piece.CopyData(image->data() + done, sums == PieceSums::kChecked ? &sum : nullptr, &mac);
    if (sums == PieceSums::kChecked && sum.Digest() != piece.fields().piece_xxh3()) {
      return DataLoss("the piece at offset " + std::to_string(done) + " failed its checksum on arrival");
    }
    done += n;
    if (received) *received += n;
    last = piece.fields().last();
    if (last) mac_sent = piece.fields().image_mac();
  }
  if (!last || done != file_bytes) {
    return DataLoss("the stream ended after " + std::to_string(done) + " of " + std::to_string(file_bytes) + " bytes");
  }
  const std::string binding = PeerSecret::ImageBinding(check.call, check.nonce, meta.job, meta.version, meta.rank,
                                                       meta.session, head.origin(), file_bytes);
  if (!PeerSecret::SameMac(mac.Finish(binding), mac_sent)) {
    return PermissionDenied("the shard image " + std::string(mac_sent.empty() ? "carries no" : "carries a wrong") +
                            " MAC of --peer-secret for this transfer: the sender did not prove it knows the secret "
                            "(not a ckptd of this cluster, or one of an older release), or the bytes changed on the "
                            "way; no byte of it is used");
  }
  return image;
}

// Streams `image` through `write` in pieces of `piece` bytes (the first holding the whole header),
// each referencing the image's memory (EncodePiece: no copy, and the image stays alive until
// gRPC has sent it), with its xxh3-64 when `sums` is kChecked, and on the last piece the MAC
// of every byte and `binding` (PeerSecret::ImageBinding).
template <typename Write>
bool SendImage(const std::shared_ptr<MemoryImage>& image, const std::string& origin, std::uint64_t piece,
               PieceSums sums, PeerSecret::ImageMac mac, const std::string& binding, Write write,
               const std::function<void()>& pace) {
  const std::uint64_t file_bytes = image->file_bytes;
  const std::uint64_t header_end = HeaderEnd(image->data(), file_bytes);
  std::uint64_t off = 0;
  do {
    std::uint64_t n = std::min<std::uint64_t>(piece, file_bytes - off);
    if (off == 0) n = std::max<std::uint64_t>(n, header_end);
    if (pace) pace();
    v1::ShardPiece fields;
    if (off == 0) {
      auto* k = fields.mutable_key();
      k->set_job(image->meta.job);
      k->set_version(image->meta.version);
      k->set_rank(image->meta.rank);
      fields.set_file_bytes(file_bytes);
      fields.set_origin(origin);
    }
    fields.set_offset(off);
    if (sums == PieceSums::kChecked) fields.set_piece_xxh3(Checksum::Of(image->data() + off, n));
    const char* data = image->data() + off;
    mac.Update(data, n);
    off += n;
    if (off == file_bytes) {
      fields.set_last(true);
      fields.set_image_mac(mac.Finish(binding));
    }
    if (!write(EncodePiece(fields, image, data, n), n)) return false;
  } while (off < file_bytes);
  return true;
}

}  // namespace

// The Peer service: every call is checked against the shared secret first.
class PeerServiceImpl final : public v1::Peer::Service {
 public:
  explicit PeerServiceImpl(Replicator& r) : r_(r) {
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
    if (!reader->Read(&buffer)) return ToGrpc(DataLoss("PutShard: the stream ended before its first piece"));
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
    auto make = [&](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) {
      bool own = false;
      reserved = r_.memory().ReserveReplica(meta, file_bytes, origin.empty() ? "?" : origin, &own);
      if (!reserved && own) {
        *why = "this daemon holds its own shard of " + Describe(meta.job, meta.version, meta.rank) +
               " (the rank ran here): a replica of it adds nothing";
      } else if (!reserved) {
        *why = "no room for " + Describe(meta.job, meta.version, meta.rank) + " (" + std::to_string(file_bytes >> 20) +
               " MiB) in this daemon's memory tier without dropping its own shards (--memory-mib " +
               std::to_string(r_.memory().GetStats().budget >> 20) + ")";
      }
      return reserved;
    };
    std::uint64_t received = 0;
    auto image = ReceiveImage(
        head, [&](grpc::ByteBuffer* b) { return reader->Read(b); }, make, v1::ShardKey(), PieceSums::kChecked,
        ImageCheck{&r_.secret(), "PutShard", nonce, ""}, &received);
    metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kReceived, received);
    if (!image.ok()) {
      if (reserved) r_.memory().Drop(reserved);
      return Refuse(image.status().With("replica from " + origin));
    }
    std::shared_ptr<MemoryImage> img = std::move(image).value();
    if (r_.corrupt_replicas() && img->file_bytes > 0) img->data()[img->file_bytes - 1] ^= 0x5a;  // test seam
    r_.memory().Complete(img);
    metrics::Metrics().Replication(metrics::ReplicationEvent::kReceived);
    spdlog::debug("peer: keeping a replica of {} from {}", Describe(img->meta.job, img->meta.version, img->meta.rank),
                  origin);
    const auto held = r_.memory().ReplicaBytes();
    auto it = held.find(origin);
    reply->set_bytes_held(it == held.end() ? 0 : it->second);
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             r_.secret().Proof("PutShard", nonce, PeerSecret::PutAnswer(subject, reply->bytes_held())));
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
    if (!stream->Read(&req)) return ToGrpc(InvalidArgument("GetShard: no request"));
    if (KeySubject(req.key()) != subject) {
      return Refuse(PermissionDenied("GetShard: the request is not for the shard its token was made for (" + subject +
                                     ")"));
    }
    if (Status st = CheckKey(req.key()); !st.ok()) return ToGrpc(st);
    auto image = r_.memory().Find(req.key().job(), req.key().version(), req.key().rank());
    if (!image) {
      return ToGrpc(NotFound("no image of " + Describe(req.key().job(), req.key().version(), req.key().rank()) +
                             " in this daemon's memory"));
    }
    std::uint64_t sent = 0;
    const std::string binding =
        PeerSecret::ImageBinding("GetShard", nonce, image->meta.job, image->meta.version, image->meta.rank,
                                 image->meta.session, r_.peers().self_address(), image->file_bytes);
    bool ok = SendImage(image, r_.peers().self_address(), kPiece, PieceSums::kNone, r_.secret().StartImage(), binding,
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
    if (Status st = CheckKey(req->key()); !st.ok()) return ToGrpc(st);
    auto image = r_.memory().Find(req->key().job(), req->key().version(), req->key().rank());
    reply->set_held(image != nullptr);
    if (image) {
      reply->set_file_bytes(image->file_bytes);
      reply->set_registration(image->meta.session);
    }
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             r_.secret().Proof("HasShard", nonce, HasAnswer(KeySubject(req->key()), *reply)));
    return grpc::Status::OK;
  }

  grpc::Status DropNewer(grpc::ServerContext* ctx, const v1::DropNewerRequest* req,
                         v1::DropJobReply* reply) override {
    std::string nonce;
    if (Status st = Auth(ctx, "DropNewer", KeySubject(req->key()), &nonce); !st.ok()) return Refuse(st);
    if (Status st = CheckKey(req->key()); !st.ok()) return ToGrpc(st);
    const auto& k = req->key();
    reply->set_dropped(r_.memory().DropNewerThan(k.job(), k.rank(), k.version()));
    if (reply->dropped() > 0) {
      spdlog::info("peer: job {} rank {} restored version {}: dropped {} image(s) of the versions above it", k.job(),
                   k.rank(), k.version(), reply->dropped());
    }
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             r_.secret().Proof("DropNewer", nonce, PeerSecret::DropAnswer(KeySubject(k), reply->dropped())));
    return grpc::Status::OK;
  }

  grpc::Status DropJob(grpc::ServerContext* ctx, const v1::DropJobRequest* req, v1::DropJobReply* reply) override {
    const std::string subject = PeerSecret::JobSubject(req->job(), req->origin());
    std::string nonce;
    if (Status st = Auth(ctx, "DropJob", subject, &nonce); !st.ok()) return Refuse(st);
    if (std::string why = CheckJobId(req->job()); !why.empty()) return ToGrpc(InvalidArgument(why));
    if (req->origin().empty()) return ToGrpc(InvalidArgument("DropJob needs its origin"));
    reply->set_dropped(r_.memory().DropReplicas(req->job(), req->origin()));
    if (reply->dropped() > 0) {
      spdlog::info("peer: job {} ended on {}: dropped {} replica(s)", req->job(), req->origin(), reply->dropped());
    }
    ctx->AddTrailingMetadata(PeerSecret::kProofKey,
                             r_.secret().Proof("DropJob", nonce, PeerSecret::DropAnswer(subject, reply->dropped())));
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
    Status st = r_.secret().Check(token, call, PeerSecret::Addressed(subject, r_.peers().self_address()));
    if (!st.ok()) {
      r_.refused_log().Warn("peer: refused a call from " + ctx->peer() + ": " + st.message());
      return st;
    }
    *nonce = PeerSecret::NonceOf(token);
    return st;
  }
  grpc::Status Refuse(const Status& st) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kRefused);
    return ToGrpc(st);
  }
  Replicator& r_;
};

Replicator::Replicator(PeerList peers, PeerSecret secret, MemoryTier& memory, Hooks hooks,
                       std::chrono::milliseconds progress_timeout)
    : peers_(std::move(peers)),
      secret_(std::move(secret)),
      memory_(memory),
      hooks_(std::move(hooks)),
      corrupt_replicas_([] {
        const char* e = std::getenv("CKPTD_TEST_CORRUPT_REPLICAS");
        return e != nullptr && std::string(e) == "1";
      }()),
      progress_timeout_(progress_timeout) {}

Result<std::unique_ptr<Replicator>> Replicator::Create(const Config& config, MemoryTier& memory, Hooks hooks) {
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
                                               std::move(hooks), std::chrono::seconds(config.peer_progress_timeout_s)));
  PeerAcceptor::Limits limits;
  limits.per_address = config.peer_max_connections_per_address;
  limits.total = config.peer_max_connections;
  if (limits.total == 0) {
    // A quarter of the open-file limit (main raised it): the rest is for the Unix socket's
    // connections, regions and shard files.
    rlimit lim{};
    const rlim_t open_files = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? lim.rlim_cur : 1024;
    limits.total = static_cast<std::uint32_t>(std::clamp<rlim_t>(open_files / 4, 16, 4096));
  }
  if (Status st = r->StartServer(config.peer_listen, limits); !st.ok()) return st;
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

Status Replicator::StartServer(const std::string& listen, PeerAcceptor::Limits limits) {
  service_ = std::make_unique<PeerServiceImpl>(*this);
  grpc::ServerBuilder builder;
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(kMaxMessage);
  builder.SetMaxSendMessageSize(kMaxMessage);
  grpc::ResourceQuota quota("ckptd-peer");
  quota.SetMaxThreads(kMaxServerThreads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kPeerIdleMs);
  // No listening port of gRPC's own: the acceptor below takes the connections, within its
  // limits, and hands them over.
  server_ = builder.BuildAndStart();
  if (!server_) return Unreachable("--peer-listen " + listen + ": cannot start the peer server");
  auto acceptor = PeerAcceptor::Start(listen, limits, [this](int fd) {
    grpc::AddInsecureChannelFromFd(server_.get(), fd);
  });
  if (!acceptor.ok()) {
    server_->Shutdown();
    server_.reset();
    return acceptor.status().code() == StatusCode::kInvalidArgument
               ? acceptor.status()
               : Unreachable(acceptor.status().message() + " (address in use or not this host's)");
  }
  acceptor_ = std::move(acceptor).value();
  bound_ = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(acceptor_->port());
  return Status::Ok();
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
  acceptor_.reset();  // before the server its thread hands connections to
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    server_.reset();
  }
}

std::shared_ptr<grpc::Channel> Replicator::ChannelTo(const std::string& peer) {
  MutexLock lock(mu_);
  auto& ch = channels_[peer];
  if (!ch) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    args.SetMaxSendMessageSize(kMaxMessage);
    // A dead peer is found out quickly, and a restarted one reached again at once.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    ch = grpc::CreateCustomChannel(peer, grpc::InsecureChannelCredentials(), args);
  }
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
        st.error = FailedPrecondition(Describe(q.job, q.version, q.rank) + " was superseded by version " +
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
    st.error = FailedPrecondition(Describe(meta.job, meta.version, meta.rank) + " is not replicated: " + why);
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
  // stops it (a flush-bound trainer keeps the pool busy all the time). It was 1 ms while
  // every piece cost the sender two copies at nice 19, which throttled it as much again;
  // without them (piece_wire.h) 1 ms let replication double the flush-bound trainer's
  // stall p50 on the 2-core VM, 3 ms keeps it at R=0's (DESIGN-NOTES, issue 17, measured).
  static_assert(kReplicaPiece == 1 << 20, "the wait is per MiB");
  if (hooks_.pool_used() > hooks_.pool_bytes / 4) std::this_thread::sleep_for(std::chrono::milliseconds(3));
}

Status Replicator::SendTo(const std::string& peer, const std::shared_ptr<MemoryImage>& shard, std::uint64_t* held) {
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
                                     image.meta.session, peers_.self_address(), image.file_bytes),
            [&](const grpc::ByteBuffer& piece, std::uint64_t n) {
              sent += n;
              const bool ok = writer->Write(piece);
              watch.Progress();
              return ok;
            },
            [this, &watch] {
              Pace();
              watch.Progress();  // the wait is this daemon's
            });
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
             FailedPrecondition(Describe(m.job, m.version, m.rank) +
                                " left the memory tier before it was sent to its peers (a newer version replaced it)"),
             0);
      continue;
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
      Status st = SendTo(peer, image, &held);
      if (st.ok()) {
        ++acks;
        metrics::Metrics().Replication(metrics::ReplicationEvent::kSent);
        MutexLock lock(mu_);
        sent_held_[peer] = held;
        sent_to_[m.job].insert(peer);
        peer_error_.erase(peer);
        continue;
      }
      metrics::Metrics().Replication(metrics::ReplicationEvent::kSendFailed);
      NoteError(peer, st.message());
      errors += (errors.empty() ? "" : "; ") + st.message();
      send_log_.Warn("replication: " + Describe(m.job, m.version, m.rank) + " not kept by " + peer + ": " +
                     st.message());
      if (st.code() == StatusCode::kPermissionDenied) {
        // Refused (another secret, another release), or an answer without proof.
        if (hooks_.error) hooks_.error("replication: " + Describe(m.job, m.version, m.rank) + " not kept: " + st.message());
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
      const std::string msg = Describe(m.job, m.version, m.rank) + " is held by " + std::to_string(acks) + " of " +
                              std::to_string(want) + " peers: " + errors;
      if (hooks_.error) hooks_.error("replication: " + msg);
      Finish(key, Unreachable(msg), acks);
    }
  }
}

void Replicator::OnJobEnded(const std::string& job) {
  std::set<std::string> told;
  {
    MutexLock lock(mu_);
    auto it = sent_to_.find(job);
    if (it == sent_to_.end()) return;  // nothing of it was replicated
    told = std::move(it->second);
    sent_to_.erase(it);
  }
  for (const std::string& peer : told) {
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
    if (Status proven = secret_.CheckProof(ProofOf(ctx), "DropJob", PeerSecret::NonceOf(token),
                                           PeerSecret::DropAnswer(subject, reply.dropped()));
        !proven.ok()) {
      Unproven(peer, proven);
      continue;
    }
    MutexLock lock(mu_);
    sent_held_.erase(peer);  // as it says on the next acknowledgement
  }
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
        hooks_.error("restore of " + Describe(job, version, rank) + ": peer " + peer +
                     (by_rule ? " (a holder by the peer rule) " : " ") + why + "; trying the next replica");
      }
      NoteError(peer, why);
    }
  }
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
                                             PeerSecret::DropAnswer(subject, reply.dropped()));
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
  auto make = [](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) {
    auto img = StandaloneImage(meta, file_bytes);
    if (!img) *why = "cannot map " + std::to_string(file_bytes) + " bytes for the fetched shard";
    return img;
  };
  std::uint64_t received = 0;
  bool ended = false;  // the stream ended (the server's status is what to report)
  // A peer that stops sending is given up: the restore goes on with the next source.
  ProgressWatch watch(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  auto next = [&](grpc::ByteBuffer* b) {
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
  metrics::Metrics().ReplicationBytesAdd(metrics::ReplicationBytes::kFetched, received);
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
    const std::string m = "fetch " + Describe(job, version, rank) + ": " + Stalled(peer, watch.limit());
    unproven_log_.Warn("replication: " + m);
    return Unreachable(m);
  }
  if (!st.ok()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    return FromGrpc(st, "fetch " + Describe(job, version, rank));
  }
  if (!image.ok()) {
    metrics::Metrics().Replication(metrics::ReplicationEvent::kPeerFallback);
    return image.status();
  }
  image.value()->complete = true;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("replication: fetched {} from peer {}: {} bytes in {:.0f} ms", Describe(job, version, rank), peer,
               received, ms);
  return image;
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
    if (auto it = sent_held_.find(p.address); it != sent_held_.end()) p.sent_bytes_held = it->second;
    if (auto it = peer_error_.find(p.address); it != peer_error_.end()) p.error = it->second;
    p.holder = std::find(rule.begin(), rule.end(), i) != rule.end();
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace ckpt
