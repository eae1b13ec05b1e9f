#include "support/fake_peer.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "ckpt/v1/peer.grpc.pb.h"
#include "common/unique_fd.h"
#include "format/checksum.h"

namespace ckpt::test {

class FakePeer::Service final : public v1::Peer::Service {
 public:
  explicit Service(FakePeer& fake) : fake_(fake) {}

  grpc::Status PutShard(grpc::ServerContext* ctx, grpc::ServerReader<v1::ShardPiece>* reader,
                        v1::PutShardReply* reply) override {
    v1::ShardPiece piece;
    std::uint64_t bytes = 0;
    while (reader->Read(&piece)) bytes += piece.data().size();
    ++fake_.puts_;
    reply->set_bytes_held(bytes);
    Prove(ctx, "PutShard", PeerSecret::PutAnswer(Metadata(ctx, PeerSecret::kSubjectKey), bytes));
    return grpc::Status::OK;
  }

  grpc::Status HasShard(grpc::ServerContext* ctx, const v1::HasShardRequest* req, v1::HasShardReply* reply) override {
    ++fake_.has_calls_;
    auto held = fake_.Find({req->key().job(), req->key().version(), req->key().rank()});
    reply->set_held(held != nullptr);
    if (held) {
      reply->set_file_bytes(held->file.size());
      reply->set_registration(held->registration);
    }
    const std::string subject = PeerSecret::ShardSubject(req->key().job(), req->key().version(), req->key().rank(), "");
    Prove(ctx, "HasShard", PeerSecret::HasAnswer(subject, reply->held(), reply->file_bytes(), reply->registration()));
    return grpc::Status::OK;
  }

  grpc::Status GetShard(grpc::ServerContext* ctx, const v1::GetShardRequest* req,
                        grpc::ServerWriter<v1::ShardPiece>* writer) override {
    ++fake_.get_calls_;
    auto held = fake_.Find({req->key().job(), req->key().version(), req->key().rank()});
    if (!held) return grpc::Status(grpc::StatusCode::NOT_FOUND, "not held");
    const std::string& file = held->file;
    std::string mac;
    if (fake_.options_.secret) {
      PeerSecret::ImageMac m = fake_.options_.secret->StartImage();
      m.Update(file.data(), file.size());
      mac = m.Finish(PeerSecret::ImageBinding("GetShard", PeerSecret::NonceOf(Metadata(ctx, PeerSecret::kMetadataKey)),
                                              req->key().job(), req->key().version(), req->key().rank(),
                                              held->registration, fake_.address_, file.size()));
    }
    constexpr std::size_t kPiece = 4 << 20;
    std::uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(file[i]);
    for (std::size_t off = 0; off < file.size();) {
      std::size_t n = std::min(kPiece, file.size() - off);
      if (off == 0) n = std::max<std::size_t>(n, 8 + header);
      v1::ShardPiece piece;
      if (off == 0) {
        *piece.mutable_key() = req->key();
        piece.set_file_bytes(file.size());
        piece.set_origin(fake_.address_);
      }
      piece.set_offset(off);
      piece.set_data(file.substr(off, n));
      off += n;
      piece.set_last(off == file.size());
      if (piece.last()) piece.set_image_mac(mac);
      if (!writer->Write(piece)) return grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
      if (fake_.options_.stall_after_first_piece) {
        while (!ctx->IsCancelled() && !fake_.stopping_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return grpc::Status(grpc::StatusCode::CANCELLED, "stalled");
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status DropJob(grpc::ServerContext*, const v1::DropJobRequest*, v1::DropJobReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status DropNewer(grpc::ServerContext*, const v1::DropNewerRequest*, v1::DropJobReply*) override {
    return grpc::Status::OK;
  }

 private:
  static std::string Metadata(grpc::ServerContext* ctx, const char* key) {
    auto it = ctx->client_metadata().find(key);
    return it == ctx->client_metadata().end() ? std::string() : std::string(it->second.data(), it->second.size());
  }
  // With the secret, the reply's proof for the caller's nonce.
  void Prove(grpc::ServerContext* ctx, const char* call, const std::string& answer) {
    if (!fake_.options_.secret) return;
    ctx->AddTrailingMetadata(
        PeerSecret::kProofKey,
        fake_.options_.secret->Proof(call, PeerSecret::NonceOf(Metadata(ctx, PeerSecret::kMetadataKey)), answer));
  }
  FakePeer& fake_;
};

FakePeer::FakePeer(const std::string& address, Options options)
    : address_(address), options_(options), service_(std::make_unique<Service>(*this)) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(80 << 20);
  builder.SetMaxSendMessageSize(80 << 20);
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) throw std::runtime_error("FakePeer: cannot listen on " + address);
}

FakePeer::~FakePeer() {
  stopping_ = true;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
}

void FakePeer::Hold(const std::string& job, std::uint64_t version, std::uint32_t rank, std::string file,
                    std::string registration) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[{job, version, rank}] = std::make_shared<const Held>(Held{std::move(file), std::move(registration)});
}

std::shared_ptr<const FakePeer::Held> FakePeer::Find(const Key& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(key);
  return it == held_.end() ? nullptr : it->second;
}

std::string RebuildShard(const ShardInfo& info, const std::function<void(const ShardItem&, char*)>& data) {
  std::vector<ShardItem> items = info.items;
  for (ShardItem& item : items) {
    item.offset = 0;
    item.checksum = 0;
  }
  auto layout = ShardLayout::Plan(info.meta, items);
  if (!layout.ok()) throw std::runtime_error("RebuildShard: " + layout.status().message());
  std::string file(layout->file_bytes(), '\0');
  for (ShardItem& item : layout->items()) {
    char* p = file.data() + layout->header_bytes() + item.offset;
    data(item, p);
    item.checksum = Checksum::Of(p, item.length);
    if (item.blocks.block_bytes != 0) item.blocks.sums = ComputeBlockSums(p, item.length, item.blocks.block_bytes);
  }
  const std::string header = layout->RenderHeader();
  std::memcpy(file.data(), header.data(), header.size());
  return file;
}

std::string ForgedShard(const std::string& path) {
  auto info = ReadShardHeader(path);
  if (!info.ok()) throw std::runtime_error("ForgedShard: " + info.status().message());
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  return RebuildShard(info.value(), [&](const ShardItem& item, char* out) {
    // Find the item's bytes in the genuine file, then change every one of them.
    for (const ShardItem& genuine : info->items) {
      if (genuine.name != item.name) continue;
      std::size_t done = 0;
      while (done < item.length) {
        ssize_t n = ::pread(fd.get(), out + done, item.length - done,
                            static_cast<off_t>(info->data_start + genuine.offset + done));
        if (n <= 0) throw std::runtime_error("ForgedShard: cannot read " + path);
        done += static_cast<std::size_t>(n);
      }
    }
    for (std::uint64_t i = 0; i < item.length; ++i) out[i] ^= 0x5a;
  });
}

}  // namespace ckpt::test
