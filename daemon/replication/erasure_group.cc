#include "daemon/replication/erasure_group.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "ckpt/v1/peer.grpc.pb.h"
#include "daemon/base/peer_list.h"
#include "daemon/replication/peer_protocol.h"
#include "daemon/replication/progress_watch.h"
#include "daemon/replication/shard_stream.h"
#include "format/checksum.h"
#include "proto/grpc_status.h"

namespace ckpt {
namespace {

constexpr std::uint64_t kPiece = 4 << 20;
constexpr std::chrono::minutes kTransferDeadline{5};
constexpr std::size_t kQueueMax = 1024;  // queued shards at most (the oldest go first)
// The largest chunk a holder takes (PutChunk refuses larger ones), so the largest parity row.
constexpr std::uint64_t kMaxChunkBytes = kMaxErasureChunkBytes;

// The xxh3-64 of `n` bytes at `data` followed by zeros up to `padded` bytes.
std::uint64_t PaddedChecksum(const void* data, std::uint64_t n, std::uint64_t padded) {
  static const std::vector<std::uint8_t> zeros(64 << 10, 0);
  Checksum sum;
  sum.Update(data, n);
  for (std::uint64_t at = n; at < padded;) {
    const std::uint64_t z = std::min<std::uint64_t>(zeros.size(), padded - at);
    sum.Update(zeros.data(), z);
    at += z;
  }
  return sum.Digest();
}

std::string ProofOf(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(PeerSecret::kProofKey);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

bool EnvIs(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::string(e) == value;
}

}  // namespace

Result<std::unique_ptr<ErasureGroup>> ErasureGroup::Create(const Config& config, MemoryTier& memory,
                                                           bool start_server,
                                                           std::function<void(const std::string&)> error) {
  const std::string flag = "--erasure " + std::to_string(config.erasure_k) + "+" + std::to_string(config.erasure_m);
  auto code = ErasureCode::Create(config.erasure_k, config.erasure_m);
  if (!code.ok()) return code.status().With(flag);
  if (!memory.enabled()) {
    return InvalidArgument(flag + " needs a memory tier (--memory-mib and --memory-versions above 0)");
  }
  auto secret = PeerSecret::Load(config.peer_secret);
  if (!secret.ok()) return secret.status();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const char* slurm = std::getenv("SLURM_JOB_NODELIST");
  auto peers = ResolvePeers(config.peers, config.peer_listen, config.replicas, slurm ? slurm : "", host);
  if (!peers.ok()) return peers.status();
  const unsigned n = config.erasure_k + config.erasure_m;
  const auto& all = peers.value().addresses;
  if (all.size() % n != 0) {
    return InvalidArgument(flag + ": --peers names " + std::to_string(all.size()) +
                           " daemons, not a multiple of K+M = " + std::to_string(n));
  }
  ErasureGeometry g;
  g.k = config.erasure_k;
  g.m = config.erasure_m;
  const std::size_t first = peers.value().self / n * n;
  g.members.assign(all.begin() + static_cast<std::ptrdiff_t>(first),
                   all.begin() + static_cast<std::ptrdiff_t>(first + n));
  g.self = static_cast<unsigned>(peers.value().self - first);
  std::unique_ptr<ErasureGroup> e(new ErasureGroup(std::move(code).value(), std::move(g), config.memory_versions,
                                                   config.memory_mib << 20, std::move(secret).value(),
                                                   std::chrono::seconds(config.peer_progress_timeout_s),
                                                   std::move(error)));
  if (start_server) {
    const PeerAcceptor::Limits limits =
        PeerAcceptor::LimitsOf(config.peer_max_connections, config.peer_max_connections_per_address);
    auto server = PeerServer::Start(config.peer_listen, limits, memory, &e->store_, e->secret_,
                                    peers.value().self_address());
    if (!server.ok()) return server.status();
    e->server_ = std::move(server).value();
  }
  e->sender_ = std::thread([p = e.get()] { p->SendLoop(); });
  spdlog::info("erasure: {}", e->Describe());
  return e;
}

ErasureGroup::ErasureGroup(ErasureCode code, ErasureGeometry geometry, std::uint32_t versions_kept,
                           std::uint64_t max_parity_bytes, PeerSecret secret,
                           std::chrono::milliseconds progress_timeout, std::function<void(const std::string&)> error)
    : store_(std::move(code), std::move(geometry), versions_kept, max_parity_bytes,
             EnvIs("CKPTD_TEST_CORRUPT_PARITY", "1")),
      secret_(std::move(secret)),
      progress_timeout_(progress_timeout),
      error_(std::move(error)) {}

ErasureGroup::~ErasureGroup() { Stop(); }

void ErasureGroup::Stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
    if (sending_ != nullptr) sending_->TryCancel();  // the send in flight
  }
  changed_.SignalAll();
  if (sender_.joinable()) sender_.join();
  server_.reset();
}

std::string ErasureGroup::Describe() const {
  const ErasureGeometry& g = geometry();
  std::string members;
  for (const auto& a : g.members) members += (members.empty() ? "" : ", ") + a;
  return std::to_string(g.k) + "+" + std::to_string(g.m) + ", position " + std::to_string(g.self) +
         " of the group (" + members + ")";
}

ErasureGroup::Counters ErasureGroup::counters() {
  MutexLock lock(mu_);
  return Counters{chunks_sent_.load(), send_failures_.load(), rebuilds_.load(), rebuild_failures_.load(),
                  corrupt_.load(), queue_.size() + (busy_ ? 1 : 0)};
}

void ErasureGroup::Note(const std::string& message) {
  log_.Warn("erasure: " + message);
  if (error_) error_(message);
}

std::shared_ptr<grpc::Channel> ErasureGroup::ChannelTo(const std::string& peer) {
  MutexLock lock(mu_);
  auto& ch = channels_[peer];
  if (!ch) ch = NewPeerChannel(peer);
  return ch;
}

void ErasureGroup::Enqueue(std::shared_ptr<MemoryImage> image) {
  if (!image) return;
  const ShardMeta m = image->meta;
  {
    MutexLock lock(mu_);
    if (stopping_) return;
    // A newer version of the rank supersedes one not sent yet.
    std::erase_if(queue_, [&](const Queued& q) {
      return q.meta.job == m.job && q.meta.rank == m.rank && q.meta.version < m.version;
    });
    if (queue_.size() >= kQueueMax) {
      ++send_failures_;
      log_.Warn("erasure: " + DescribeShard(queue_.front().meta.job, queue_.front().meta.version,
                                            queue_.front().meta.rank) + " not protected: too many shards queued");
      queue_.pop_front();
    }
    queue_.push_back(Queued{m, image});
    dropped_above_.erase(m.job);  // a new version: a later rollback drops again
  }
  changed_.Signal();
}

std::uint32_t ErasureGroup::SlotOf(const ShardMeta& meta) {
  MutexLock lock(mu_);
  auto& ranks = slots_[{meta.job, meta.version}];
  auto it = ranks.find(meta.rank);
  if (it == ranks.end()) it = ranks.emplace(meta.rank, static_cast<std::uint32_t>(ranks.size())).first;
  // Bounded: the slots of a job's versions far behind its newest are not needed again.
  for (auto old = slots_.begin(); old != slots_.end();) {
    if (old->first.first == meta.job && old->first.second + 64 < meta.version) {
      old = slots_.erase(old);
    } else {
      ++old;
    }
  }
  return it->second;
}

void ErasureGroup::SendLoop() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  for (;;) {
    Queued q;
    {
      MutexLock lock(mu_);
      busy_ = false;
      while (!stopping_ && queue_.empty()) changed_.Wait(mu_);
      if (stopping_) return;
      q = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    std::shared_ptr<MemoryImage> image = q.image.lock();
    if (!image) continue;  // the memory tier dropped it: a newer version replaced it
    if (Status st = SendShard(image, SlotOf(q.meta)); !st.ok() && st.code() != StatusCode::kCancelled) {
      Note("protecting " + DescribeShard(q.meta.job, q.meta.version, q.meta.rank) + ": " + st.message());
    }
  }
}

Status ErasureGroup::SendShard(const std::shared_ptr<MemoryImage>& image, std::uint32_t slot) {
  const ErasureGeometry& g = geometry();
  std::uint64_t generation = 0;
  {
    MutexLock lock(mu_);
    generation = generation_[image->meta.job];
    sending_job_ = image->meta.job;
    sending_version_ = image->meta.version;
  }
  const std::uint64_t length = image->file_bytes;
  const std::uint64_t chunk = StripeFragmentBytes(length, g.k);
  Status first_error;
  for (unsigned c = 0; c < g.k; ++c) {
    {
      MutexLock lock(mu_);
      if (stopping_) return Cancelled("the daemon is stopping");
      // A restore left the timeline since this shard was queued: the rest is not sent.
      if (generation_[image->meta.job] != generation) {
        if (auto d = dropped_above_.find(image->meta.job);
            d != dropped_above_.end() && image->meta.version > d->second) {
          return Cancelled("a restore left the timeline of this version");
        }
      }
    }
    const std::uint64_t begin = std::min<std::uint64_t>(length, c * chunk);
    const std::uint64_t n = std::min<std::uint64_t>(length, begin + chunk) - begin;
    v1::StripeMember member;
    member.set_job(image->meta.job);
    member.set_version(image->meta.version);
    member.set_slot(slot);
    member.set_stripe(g.StripeOf(g.self, c));
    member.set_position(c);
    member.set_rank(image->meta.rank);
    member.set_world_size(image->meta.world_size);
    member.set_registration(image->meta.session);
    member.set_origin(g.members[g.self]);
    member.set_file_bytes(length);
    member.set_chunk_bytes(chunk);
    member.set_chunk_xxh3(PaddedChecksum(image->data() + begin, n, chunk));
    for (unsigned j = 0; j < g.m; ++j) {
      const std::string& holder = g.members[g.HolderOf(member.stripe(), j)];
      Status st = SendChunk(holder, member, image->data() + begin, n);
      if (st.ok()) {
        ++chunks_sent_;
        continue;
      }
      ++send_failures_;
      if (first_error.ok()) first_error = st.With("chunk " + std::to_string(c) + " to " + holder);
    }
  }
  return first_error;
}

Status ErasureGroup::SendChunk(const std::string& holder, const v1::StripeMember& member, const char* data,
                               std::uint64_t n) {
  if (member.chunk_bytes() == 0) return Status::Ok();  // an empty image has nothing to protect
  auto stub = v1::Peer::NewStub(ChannelTo(holder));
  grpc::ClientContext ctx;
  const std::string subject =
      PeerSecret::ShardSubject(member.job(), member.version(), member.rank(), member.origin());
  const std::string token = secret_.Token("PutChunk", PeerSecret::Addressed(subject, holder));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
  ctx.set_deadline(std::chrono::system_clock::now() + kTransferDeadline);
  const std::string nonce = PeerSecret::NonceOf(token);
  v1::PutChunkReply reply;
  {
    MutexLock lock(mu_);
    if (stopping_) return Cancelled("the daemon is stopping");
    sending_ = &ctx;
  }
  struct Clear {
    ErasureGroup* self;
    ~Clear() {
      MutexLock lock(self->mu_);
      self->sending_ = nullptr;
    }
  } clear{this};
  // Watched while the pieces go; the holder's answer then takes its checks and the fold, of
  // time that grows with the chunk, within the call's deadline.
  auto watch = std::make_unique<ProgressWatch>(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  std::unique_ptr<grpc::ClientWriter<v1::ChunkPiece>> writer(stub->PutChunk(&ctx, &reply));
  PeerSecret::ImageMac mac = secret_.StartImage();
  v1::ChunkPiece piece;
  *piece.mutable_member() = member;
  std::uint64_t at = 0;
  bool written = true;
  do {
    const std::uint64_t len = std::min<std::uint64_t>(kPiece, n - at);
    piece.set_offset(at);
    piece.set_data(data + at, len);
    mac.Update(data + at, len);
    at += len;
    if (at == n) {
      piece.set_last(true);
      piece.set_mac(mac.Finish(ChunkBinding("PutChunk", nonce, member)));
    }
    written = writer->Write(piece);
    watch->Progress();
    piece.Clear();
  } while (written && at < n);
  writer->WritesDone();
  const bool stalled = watch->fired();
  watch.reset();
  grpc::Status st = writer->Finish();
  if (stalled) {
    return Unreachable("PutChunk: " + holder + " moved no byte for " + std::to_string(progress_timeout_.count() / 1000) +
                       " s: given up");
  }
  if (!st.ok()) return FromGrpc(st, "PutChunk");
  return secret_.CheckProof(ProofOf(ctx), "PutChunk", nonce, ChunkBinding("PutChunk", nonce, member));
}

std::vector<std::string> ErasureGroup::Holding(const std::string&, std::uint64_t, std::uint32_t) {
  return {kSource};
}

Result<std::shared_ptr<MemoryImage>> ErasureGroup::Fetch(const std::string& peer, const std::string& job,
                                                         std::uint64_t version, std::uint32_t rank) {
  if (peer != kSource) return FailedPrecondition("no replica source " + peer + " here (erasure coding only)");
  return Rebuild(job, version, rank);
}

void ErasureGroup::DropNewer(const std::string& job, std::uint32_t, std::uint64_t version) {
  {
    MutexLock lock(mu_);
    // Every rank of the job restores the same version: the group is told once.
    if (auto it = dropped_above_.find(job); it != dropped_above_.end() && it->second == version) return;
    dropped_above_[job] = version;
    ++generation_[job];
    // The shard being sent, if above it, stops: its remaining chunks belong to the timeline left.
    if (sending_ != nullptr && sending_job_ == job && sending_version_ > version) sending_->TryCancel();
    for (auto it = slots_.begin(); it != slots_.end();) {
      it = it->first.first == job && it->first.second > version ? slots_.erase(it) : std::next(it);
    }
    // What is queued above it belongs to the timeline left.
    std::erase_if(queue_, [&](const Queued& q) { return q.meta.job == job && q.meta.version > version; });
  }
  store_.Drop(job, version, false);
  TellGroupToDrop(job, version, false);
}

void ErasureGroup::TellGroupToDrop(const std::string& job, std::uint64_t version, bool all) {
  for (const std::string& peer : geometry().members) {
    if (peer == geometry().members[geometry().self]) continue;
    auto stub = v1::Peer::NewStub(ChannelTo(peer));
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::JobSubject(job, "");
    const std::string token = secret_.Token("DropParity", PeerSecret::Addressed(subject, peer));
    ctx.AddMetadata(PeerSecret::kMetadataKey, token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::DropParityRequest req;
    req.set_job(job);
    req.set_version(version);
    req.set_drop_all(all);
    v1::DropJobReply reply;
    grpc::Status st = stub->DropParity(&ctx, req, &reply);
    if (!st.ok()) {
      spdlog::info("erasure: peer {} did not drop the parity of job {}{}: {}", peer, job,
                   all ? "" : " above version " + std::to_string(version), st.error_message());
    }
  }
}

void ErasureGroup::OnCommitted(const std::string& job, std::uint64_t version) { store_.OnCommitted(job, version); }

void ErasureGroup::OnJobFinished(const std::string& job) {
  {
    MutexLock lock(mu_);
    std::erase_if(slots_, [&](const auto& e) { return e.first.first == job; });
    dropped_above_.erase(job);
  }
  store_.Drop(job, 0, true);
  TellGroupToDrop(job, 0, true);
}

Status ErasureGroup::CheckMembers(const v1::ParityPiece& first, const std::string& job, std::uint64_t version,
                                  unsigned stripe) const {
  const ErasureGeometry& g = geometry();
  if (first.members_size() != static_cast<int>(g.k)) return DataLoss("not one member entry per data position");
  if (first.row() >= g.m || g.HolderOf(stripe, first.row()) == g.self) return DataLoss("no such parity row");
  std::uint64_t width = 0;
  for (int p = 0; p < first.members_size(); ++p) {
    const v1::StripeMember& m = first.members(p);
    if (m.origin().empty()) {  // never folded in: an empty entry
      if (m.chunk_bytes() != 0 || m.file_bytes() != 0) return DataLoss("an empty member entry with sizes");
      continue;
    }
    if (m.job() != job || m.version() != version || m.stripe() != stripe || m.position() != static_cast<unsigned>(p) ||
        m.origin() != g.members[g.DataAt(stripe, p)]) {
      return DataLoss("member entry " + std::to_string(p) + " names another place");
    }
    if (m.chunk_bytes() > kMaxChunkBytes || m.file_bytes() > kMaxChunkBytes * g.k ||
        m.chunk_bytes() != StripeFragmentBytes(m.file_bytes(), g.k)) {
      return DataLoss("member entry " + std::to_string(p) + " has sizes that do not fit each other");
    }
    width = std::max<std::uint64_t>(width, m.chunk_bytes());
  }
  if (first.parity_bytes() != width) return DataLoss("the parity's size is not its widest member's chunk");
  return Status::Ok();
}

Result<ErasureGroup::Row> ErasureGroup::ReadParity(const std::string& holder, const std::string& job,
                                                   std::uint64_t version, unsigned stripe, std::uint32_t rank) {
  const std::string self = geometry().members[geometry().self];
  auto stub = v1::Peer::NewStub(ChannelTo(holder));
  grpc::ClientContext ctx;
  const std::string subject = PeerSecret::ShardSubject(job, version, rank, self);
  const std::string token = secret_.Token("GetParity", PeerSecret::Addressed(subject, holder));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.set_deadline(std::chrono::system_clock::now() + kTransferDeadline);
  v1::GetParityRequest req;
  req.set_job(job);
  req.set_version(version);
  req.set_stripe(stripe);
  req.set_origin(self);
  req.set_rank(rank);
  ProgressWatch watch(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  std::unique_ptr<grpc::ClientReader<v1::ParityPiece>> reader(stub->GetParity(&ctx, req));
  v1::ParityPiece first, piece;
  Row row;
  PeerSecret::ImageMac mac = secret_.StartImage();
  bool got_first = false, last = false;
  Status bad;
  while (!last && reader->Read(&piece)) {
    if (!got_first) {
      first = piece;
      first.clear_data();
      first.clear_offset();
      first.clear_last();
      first.clear_mac();
      got_first = true;
      // Checked before a byte is reserved: the sizes must be those the member entries imply.
      if (Status st = CheckMembers(first, job, version, stripe); !st.ok()) {
        bad = DataLoss("parity of stripe " + std::to_string(stripe) + " from " + holder + ": " + st.message());
        break;
      }
    }
    watch.Progress();
    if (piece.offset() != row.bytes.size() || piece.data().size() > first.parity_bytes() - row.bytes.size()) {
      bad = DataLoss("parity of stripe " + std::to_string(stripe) + " from " + holder + ": a piece out of place");
      break;
    }
    row.bytes.insert(row.bytes.end(), piece.data().begin(), piece.data().end());
    mac.Update(piece.data().data(), piece.data().size());
    last = piece.last();
  }
  if (!bad.ok() || (got_first && !last)) ctx.TryCancel();
  grpc::Status st = reader->Finish();
  if (!bad.ok()) return bad;
  if (watch.fired()) {
    return Unreachable("parity of stripe " + std::to_string(stripe) + ": " + holder + " moved no byte for " +
                       std::to_string(watch.limit().count() / 1000) + " s: given up");
  }
  if (!st.ok()) return FromGrpc(st, "parity of stripe " + std::to_string(stripe) + " from " + holder);
  if (!got_first || !last || row.bytes.size() != first.parity_bytes()) {
    return DataLoss("parity of stripe " + std::to_string(stripe) + " from " + holder + " ended early");
  }
  if (!PeerSecret::SameMac(mac.Finish(ParityBinding(PeerSecret::NonceOf(token), first)), piece.mac())) {
    return PermissionDenied("parity of stripe " + std::to_string(stripe) + " from " + holder +
                            ": its MAC does not match (not a daemon of the cluster)");
  }
  if (Checksum::Of(row.bytes.data(), row.bytes.size()) != first.parity_xxh3()) {
    ++corrupt_;
    return DataLoss("parity row " + std::to_string(first.row()) + " of stripe " + std::to_string(stripe) +
                    " held by " + holder + " does not match its checksum (corrupt)");
  }
  row.row = first.row();
  row.members.assign(first.members().begin(), first.members().end());
  return row;
}

Result<std::vector<std::uint8_t>> ErasureGroup::ReadRange(const std::string& peer, const std::string& job,
                                                         std::uint64_t version, std::uint32_t rank,
                                                         std::uint64_t offset, std::uint64_t length) {
  auto stub = v1::Peer::NewStub(ChannelTo(peer));
  grpc::ClientContext ctx;
  const std::string subject = PeerSecret::ShardSubject(job, version, rank, "");
  const std::string token = secret_.Token("GetChunk", PeerSecret::Addressed(subject, peer));
  ctx.AddMetadata(PeerSecret::kMetadataKey, token);
  ctx.set_deadline(std::chrono::system_clock::now() + kTransferDeadline);
  v1::GetChunkRequest req;
  req.mutable_key()->set_job(job);
  req.mutable_key()->set_version(version);
  req.mutable_key()->set_rank(rank);
  req.set_offset(offset);
  req.set_length(length);
  ProgressWatch watch(progress_timeout_, [&ctx] { ctx.TryCancel(); });
  std::unique_ptr<grpc::ClientReader<v1::ChunkPiece>> reader(stub->GetChunk(&ctx, req));
  std::vector<std::uint8_t> out;
  out.reserve(length);
  PeerSecret::ImageMac mac = secret_.StartImage();
  v1::ChunkPiece piece;
  bool last = false, bad = false;
  while (!last && reader->Read(&piece)) {
    if (piece.offset() != offset + out.size() || piece.data().size() > length - out.size()) {
      bad = true;
      break;
    }
    out.insert(out.end(), piece.data().begin(), piece.data().end());
    mac.Update(piece.data().data(), piece.data().size());
    last = piece.last();
    watch.Progress();
  }
  if (bad || !last) ctx.TryCancel();
  grpc::Status st = reader->Finish();
  const std::string what = DescribeShard(job, version, rank) + " bytes from " + peer;
  if (bad) return DataLoss(what + ": a piece out of place");
  if (watch.fired()) {
    return Unreachable(what + ": moved no byte for " + std::to_string(watch.limit().count() / 1000) + " s: given up");
  }
  if (!st.ok()) return FromGrpc(st, what);
  if (!last || out.size() != length) return DataLoss(what + ": the stream ended early");
  if (!PeerSecret::SameMac(mac.Finish(RangeBinding(PeerSecret::NonceOf(token), job, version, rank, offset, length)),
                           piece.mac())) {
    return PermissionDenied(what + ": the MAC does not match (not a daemon of the cluster)");
  }
  return out;
}

Result<std::shared_ptr<MemoryImage>> ErasureGroup::Rebuild(const std::string& job, std::uint64_t version,
                                                           std::uint32_t rank) {
  try {
    return RebuildShard(job, version, rank);
  } catch (const std::exception& e) {  // an allocation or a thread the machine could not give
    ++rebuild_failures_;
    const std::string m = "rebuild of " + DescribeShard(job, version, rank) + " from its erasure-coding group: " +
                          e.what();
    Note(m);
    return ResourceExhausted(m);
  }
}

Result<std::shared_ptr<MemoryImage>> ErasureGroup::RebuildShard(const std::string& job, std::uint64_t version,
                                                                std::uint32_t rank) {
  const auto start = std::chrono::steady_clock::now();
  const ErasureGeometry& g = geometry();
  const ErasureCode& code = store_.code();
  const std::string self = g.members[g.self];
  const std::string what = "rebuild of " + DescribeShard(job, version, rank) + " from its erasure-coding group";
  auto fail = [&](const Status& st) -> Result<std::shared_ptr<MemoryImage>> {
    if (st.code() == StatusCode::kNotFound) {
      // No parity of that version (an old one, or one this daemon's ranks did not write):
      // not a failure of the group, the restore reads the next source.
      spdlog::info("erasure: {}: {}", what, st.message());
      return st;
    }
    ++rebuild_failures_;
    Note(what + ": " + st.message());
    return st;
  };
  std::shared_ptr<MemoryImage> image;
  std::uint64_t own_chunk = 0;
  for (unsigned c = 0; c < g.k; ++c) {
    const unsigned s = g.StripeOf(g.self, c);
    std::vector<Row> rows(g.m);
    std::vector<bool> have_row(g.m, false);
    std::vector<v1::StripeMember> members;
    std::string row_errors;
    bool only_not_found = true;  // every holder said it has no such parity
    for (unsigned j = 0; j < g.m; ++j) {
      const std::string& holder = g.members[g.HolderOf(s, j)];
      auto row = ReadParity(holder, job, version, s, rank);
      if (!row.ok()) {
        row_errors += (row_errors.empty() ? "" : "; ") + row.status().message();
        only_not_found = only_not_found && row.status().code() == StatusCode::kNotFound;
        continue;
      }
      if (row.value().row >= g.m || have_row[row.value().row]) continue;
      if (members.empty()) members = row.value().members;
      // A row folded from other members than the first (a send to one holder failed) would
      // decode garbage: only rows of the same members are used.
      if (!std::equal(members.begin(), members.end(), row.value().members.begin(), row.value().members.end(),
                      [](const v1::StripeMember& a, const v1::StripeMember& b) {
                        return a.SerializeAsString() == b.SerializeAsString();
                      })) {
        row_errors += (row_errors.empty() ? "" : "; ") + std::string("parity row from ") + holder +
                      " was folded from other members";
        continue;
      }
      const unsigned r = row.value().row;
      rows[r] = std::move(row).value();
      have_row[r] = true;
    }
    if (members.empty()) {
      const std::string why = "no parity of stripe " + std::to_string(s) + " could be read (" + row_errors + ")";
      return fail(only_not_found ? NotFound(why) : DataLoss(why));
    }
    const v1::StripeMember& me = members[c];
    if (me.origin() != self || me.rank() != rank || me.job() != job || me.version() != version) {
      return fail(DataLoss("stripe " + std::to_string(s) + " holds no chunk " + std::to_string(c) + " of this shard"));
    }
    if (!image) {
      ShardMeta meta{job, version, rank, me.world_size(), me.registration()};
      image = StandaloneImage(meta, me.file_bytes());
      if (!image) return fail(ResourceExhausted("cannot map " + std::to_string(me.file_bytes()) + " bytes for the rebuilt shard"));
      own_chunk = me.chunk_bytes();
    }
    if (me.file_bytes() != image->file_bytes || me.chunk_bytes() != own_chunk ||
        me.registration() != image->meta.session || me.world_size() != image->meta.world_size) {
      return fail(DataLoss("stripe " + std::to_string(s) + " records another size or registration of this shard "
                           "than stripe " + std::to_string(g.StripeOf(g.self, 0))));
    }
    std::uint64_t width = 0;
    for (const auto& m : members) width = std::max<std::uint64_t>(width, m.chunk_bytes());
    std::vector<std::vector<std::uint8_t>> bufs(g.n());
    std::vector<const std::uint8_t*> fragments(g.n(), nullptr);
    std::string missing;
    for (unsigned p = 0; p < g.k; ++p) {
      if (p == c) continue;
      const v1::StripeMember& m = members[p];
      bufs[p].assign(width, 0);
      if (m.origin().empty()) {  // never folded in: zeros
        fragments[p] = bufs[p].data();
        continue;
      }
      const std::uint64_t begin = std::min<std::uint64_t>(m.file_bytes(), p * m.chunk_bytes());
      const std::uint64_t n = std::min<std::uint64_t>(m.file_bytes(), begin + m.chunk_bytes()) - begin;
      auto bytes = ReadRange(m.origin(), job, version, m.rank(), begin, n);
      if (!bytes.ok()) {
        missing += (missing.empty() ? "" : "; ") + bytes.status().message();
        continue;
      }
      std::memcpy(bufs[p].data(), bytes.value().data(), n);
      if (Checksum::Of(bufs[p].data(), m.chunk_bytes()) != m.chunk_xxh3()) {
        ++corrupt_;
        missing += (missing.empty() ? "" : "; ") + std::string("chunk ") + std::to_string(p) + " from " + m.origin() +
                   " does not match its checksum";
        continue;
      }
      fragments[p] = bufs[p].data();
    }
    for (unsigned j = 0; j < g.m; ++j) {
      if (!have_row[j]) continue;
      rows[j].bytes.resize(width, 0);
      fragments[g.k + j] = rows[j].bytes.data();
    }
    std::vector<std::uint8_t> lost(width, 0);
    std::vector<std::uint8_t*> out(g.n(), nullptr);
    out[c] = lost.data();
    if (Status st = code.Rebuild(fragments, out, width); !st.ok()) {
      std::string why = st.message();
      if (!row_errors.empty()) why += "; " + row_errors;
      if (!missing.empty()) why += "; " + missing;
      return fail(DataLoss("stripe " + std::to_string(s) + ": " + why));
    }
    if (Checksum::Of(lost.data(), own_chunk) != me.chunk_xxh3()) {
      return fail(DataLoss("chunk " + std::to_string(c) + " decoded from stripe " + std::to_string(s) +
                           " does not match its checksum (the stripe holds other bytes than this shard's)"));
    }
    const std::uint64_t begin = std::min<std::uint64_t>(image->file_bytes, c * own_chunk);
    const std::uint64_t n = std::min<std::uint64_t>(image->file_bytes, begin + own_chunk) - begin;
    std::memcpy(image->data() + begin, lost.data(), n);
  }
  if (!image) return fail(NotFound("nothing to rebuild"));
  image->complete = true;
  ++rebuilds_;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("erasure: rebuilt {} from its group: {} bytes in {:.0f} ms", DescribeShard(job, version, rank),
               image->file_bytes, ms);
  return image;
}

}  // namespace ckpt
