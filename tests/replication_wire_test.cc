// A ShardPiece without protobuf's copies (daemon/replication/piece_wire.*): what
// EncodePiece writes is a ShardPiece to protobuf, what protobuf writes WirePiece reads, in
// however many slices the bytes arrive, and a piece that is not well formed is refused.
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/v1/peer.grpc.pb.h"
#include "daemon/replication/piece_wire.h"
#include "daemon/replication/replicator.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "support/free_ports.h"
#include "support/test_dirs.h"

using namespace ckpt;

namespace {

std::string Pattern(std::size_t n) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7) % 251);
  return s;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  REQUIRE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` as a buffer of slices of `step` bytes (the last shorter): how TCP reads arrive.
grpc::ByteBuffer Sliced(const std::string& bytes, std::size_t step) {
  std::vector<grpc::Slice> slices;
  for (std::size_t at = 0; at < bytes.size(); at += step) {
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::ShardPiece FirstFields() {
  v1::ShardPiece f;
  f.mutable_key()->set_job("job-a");
  f.mutable_key()->set_version(42);
  f.mutable_key()->set_rank(3);
  f.set_file_bytes(1 << 20);
  f.set_origin("10.0.0.2:7000");
  f.set_offset(0);
  f.set_piece_xxh3(0x0123456789abcdefull);
  return f;
}

// A complete shard image of `items` tensors of `item_bytes` (a valid header, item checksums).
std::string ShardFile(const ShardMeta& meta, int items, std::uint64_t item_bytes) {
  std::vector<ShardItem> planned(items);
  for (int i = 0; i < items; ++i) {
    planned[i].name = "t" + std::to_string(i);
    planned[i].dtype = DType::kU8;
    planned[i].length = item_bytes;
    planned[i].shape = {static_cast<std::int64_t>(item_bytes)};
  }
  auto layout = ShardLayout::Plan(meta, planned);
  REQUIRE(layout.ok());
  std::string file(layout->file_bytes(), '\0');
  const std::string data = Pattern(layout->data_bytes());
  std::memcpy(file.data() + layout->header_bytes(), data.data(), data.size());
  for (ShardItem& item : layout->items()) item.checksum = Checksum::Of(data.data() + item.offset, item.length);
  const std::string header = layout->RenderHeader();
  std::memcpy(file.data(), header.data(), header.size());
  return file;
}

}  // namespace

TEST_CASE("an encoded piece is a ShardPiece, read back in any slicing", "[replication][wire]") {
  const std::string data = Pattern(300'000);
  auto owner = std::make_shared<std::string>(data);
  const v1::ShardPiece fields = FirstFields();
  const std::string wire = Flatten(EncodePiece(fields, owner, owner->data(), owner->size()));

  v1::ShardPiece parsed;
  REQUIRE(parsed.ParseFromString(wire));
  CHECK(parsed.key().job() == "job-a");
  CHECK(parsed.key().version() == 42);
  CHECK(parsed.key().rank() == 3);
  CHECK(parsed.origin() == "10.0.0.2:7000");
  CHECK(parsed.piece_xxh3() == 0x0123456789abcdefull);
  CHECK(parsed.data() == data);

  for (std::size_t step : {std::size_t{1}, std::size_t{7}, std::size_t{4096}, wire.size()}) {
    INFO("slices of " << step << " bytes");
    auto piece = WirePiece::Parse(Sliced(wire, step));
    REQUIRE(piece.ok());
    const v1::ShardPiece& f = piece->fields();
    CHECK(f.key().job() == "job-a");
    CHECK(f.key().version() == 42);
    CHECK(f.key().rank() == 3);
    CHECK(f.file_bytes() == (1u << 20));
    CHECK(f.origin() == "10.0.0.2:7000");
    CHECK(f.offset() == 0);
    CHECK(f.piece_xxh3() == 0x0123456789abcdefull);
    CHECK_FALSE(f.last());
    CHECK(f.data().empty());
    REQUIRE(piece->data_bytes() == data.size());
    std::string out(data.size(), '\0');
    Checksum sum;
    piece->CopyData(out.data(), &sum);
    CHECK(out == data);
    CHECK(sum.Digest() == Checksum::Of(data.data(), data.size()));
  }
}

TEST_CASE("a piece protobuf wrote is read, fields this daemon does not know skipped", "[replication][wire]") {
  v1::ShardPiece p;
  p.set_offset(4 << 20);
  p.set_data(Pattern(5000));
  p.set_last(true);
  std::string wire = p.SerializeAsString();
  // Field 7 (fixed64: the whole-image checksum older daemons sent) and field 20 (varint).
  wire += std::string("\x39", 1) + std::string(8, '\x11');
  wire += std::string("\xa0\x01\x05", 3);
  auto piece = WirePiece::Parse(Sliced(wire, 1000));
  REQUIRE(piece.ok());
  CHECK(piece->fields().offset() == (4u << 20));
  CHECK(piece->fields().last());
  CHECK_FALSE(piece->fields().has_key());
  std::string out(piece->data_bytes(), '\0');
  piece->CopyData(out.data(), nullptr);
  CHECK(out == p.data());
}

TEST_CASE("a piece that is not well formed is refused", "[replication][wire]") {
  auto owner = std::make_shared<std::string>(Pattern(1000));
  const std::string wire = Flatten(EncodePiece(FirstFields(), owner, owner->data(), owner->size()));
  auto refused = [](const std::string& bytes) {
    auto piece = WirePiece::Parse(Sliced(bytes, 64));
    return !piece.ok() && piece.status().code() == StatusCode::kDataLoss;
  };
  SECTION("cut inside its data") { CHECK(refused(wire.substr(0, wire.size() - 1))); }
  SECTION("a known field with another wire type") { CHECK(refused(wire + std::string("\x21\x01", 2))); }
  SECTION("data twice") { CHECK(refused(wire + std::string("\x2a\x01x", 3))); }
  SECTION("a group (wire type 3)") { CHECK(refused(wire + std::string("\x4b", 1))); }
  SECTION("a varint longer than 10 bytes") { CHECK(refused(std::string("\x20", 1) + std::string(11, '\xff'))); }
}

TEST_CASE("an encoded piece holds its owner until the buffer is let go", "[replication][wire]") {
  auto owner = std::make_shared<std::string>(Pattern(100));
  std::weak_ptr<std::string> watch = owner;
  {
    grpc::ByteBuffer buffer = EncodePiece(FirstFields(), owner, owner->data(), owner->size());
    owner.reset();
    CHECK_FALSE(watch.expired());
    grpc::ByteBuffer copy = buffer;  // gRPC's send path copies the buffer: slices shared
    buffer.Clear();
    CHECK_FALSE(watch.expired());
    CHECK(Flatten(copy).size() > 100);
  }
  CHECK(watch.expired());
}

TEST_CASE("a peer's raw handlers speak ShardPiece to a generated Peer client, both ways", "[replication][wire]") {
  test::TempDir dir("wire");
  const std::string secret_path = dir.path() + "/secret";
  std::ofstream(secret_path) << "a secret of at least sixteen bytes";
  ::chmod(secret_path.c_str(), 0600);
  const std::vector<int> ports = test::FreePorts(2);
  const std::string self = "127.0.0.1:" + std::to_string(ports[0]);
  const std::string other = "127.0.0.1:" + std::to_string(ports[1]);
  MemoryTier memory(256 << 20, 2);
  Config config;
  config.replicas = 1;
  config.peers = {self, other};
  config.peer_listen = self;
  config.peer_secret = secret_path;
  auto replicator = Replicator::Create(config, memory, {});
  REQUIRE(replicator.ok());
  auto secret = PeerSecret::Load(secret_path);
  REQUIRE(secret.ok());
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(65 << 20);  // as the daemons' channels: pieces are 4 MiB and more
  auto stub = v1::Peer::NewStub(grpc::CreateCustomChannel(self, grpc::InsecureChannelCredentials(), args));
  // 9 MiB of data: three 4 MiB GetShard pieces, the last one short.
  const ShardMeta own{"wire-job", 4, 0, 2, ""};
  const std::string file = ShardFile(own, 3, 3 << 20);
  auto image = memory.Reserve(own, file.size());
  REQUIRE(image);
  std::memcpy(image->data(), file.data(), file.size());
  memory.Complete(image);

  SECTION("GetShard") {
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::ShardSubject(own.job, own.version, own.rank, "");
    const std::string token = secret->Token("GetShard", PeerSecret::Addressed(subject, self));
    ctx.AddMetadata(PeerSecret::kMetadataKey, token);
    ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
    v1::GetShardRequest req;
    req.mutable_key()->set_job(own.job);
    req.mutable_key()->set_version(own.version);
    req.mutable_key()->set_rank(own.rank);
    auto reader = stub->GetShard(&ctx, req);
    v1::ShardPiece piece;
    std::string got, mac;
    int pieces = 0;
    bool last = false;
    while (reader->Read(&piece)) {
      if (pieces++ == 0) {
        CHECK(piece.key().job() == own.job);
        CHECK(piece.file_bytes() == file.size());
        CHECK(piece.origin() == self);
      }
      CHECK(piece.offset() == got.size());
      CHECK(piece.piece_xxh3() == 0);  // GetShard sends none: the restore verifies the items
      got += piece.data();
      last = piece.last();
      if (last) mac = piece.image_mac();
    }
    grpc::Status st = reader->Finish();
    INFO(st.error_message());
    REQUIRE(st.ok());
    CHECK(last);
    CHECK(pieces == 3);
    CHECK(got == file);
    // The last piece's MAC is of every byte, for this call's nonce, from this node.
    PeerSecret::ImageMac want = secret->StartImage();
    want.Update(file.data(), file.size());
    CHECK(PeerSecret::SameMac(mac, want.Finish(PeerSecret::ImageBinding("GetShard", PeerSecret::NonceOf(token), own.job,
                                                                        own.version, own.rank, own.session, self,
                                                                        file.size()))));
  }

  SECTION("GetShard: a token made for another daemon (relayed) is refused") {
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::ShardSubject(own.job, own.version, own.rank, "");
    ctx.AddMetadata(PeerSecret::kMetadataKey, secret->Token("GetShard", PeerSecret::Addressed(subject, other)));
    ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
    v1::GetShardRequest req;
    req.mutable_key()->set_job(own.job);
    req.mutable_key()->set_version(own.version);
    req.mutable_key()->set_rank(own.rank);
    auto reader = stub->GetShard(&ctx, req);
    v1::ShardPiece piece;
    CHECK_FALSE(reader->Read(&piece));
    grpc::Status st = reader->Finish();
    CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK_THAT(st.error_message(), Catch::Contains("for this request"));
  }

  SECTION("GetShard: a request for another shard than its token's subject is refused") {
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::ShardSubject(own.job, own.version, own.rank, "");
    ctx.AddMetadata(PeerSecret::kMetadataKey, secret->Token("GetShard", PeerSecret::Addressed(subject, self)));
    ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
    v1::GetShardRequest req;
    req.mutable_key()->set_job(own.job);
    req.mutable_key()->set_version(own.version);
    req.mutable_key()->set_rank(own.rank + 1);
    auto reader = stub->GetShard(&ctx, req);
    v1::ShardPiece piece;
    CHECK_FALSE(reader->Read(&piece));
    CHECK(reader->Finish().error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }

  SECTION("PutShard: kept once every piece and the MAC check; a bad checksum or MAC is refused") {
    const ShardMeta replica{"wire-job", 4, 1, 2, ""};
    const std::string sent = ShardFile(replica, 2, 1 << 20);
    enum Case { kBadChecksum, kNoMac, kWrongMac, kRight };
    for (Case c : {kBadChecksum, kNoMac, kWrongMac, kRight}) {
      const bool corrupt = c == kBadChecksum;
      INFO("case " << c);
      grpc::ClientContext ctx;
      const std::string subject = PeerSecret::ShardSubject(replica.job, replica.version, replica.rank, other);
      const std::string token = secret->Token("PutShard", PeerSecret::Addressed(subject, self));
      const std::string nonce = PeerSecret::NonceOf(token);
      ctx.AddMetadata(PeerSecret::kMetadataKey, token);
      ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
      PeerSecret::ImageMac mac = (c == kWrongMac ? PeerSecret("another secret of sixteen bytes") : secret.value()).StartImage();
      v1::PutShardReply reply;
      auto writer = stub->PutShard(&ctx, &reply);
      const std::uint64_t header = sent.size() - (2 << 20);
      for (std::uint64_t off = 0; off < sent.size();) {
        const std::uint64_t n = off == 0 ? header + (1 << 20) : sent.size() - off;
        v1::ShardPiece piece;
        if (off == 0) {
          piece.mutable_key()->set_job(replica.job);
          piece.mutable_key()->set_version(replica.version);
          piece.mutable_key()->set_rank(replica.rank);
          piece.set_file_bytes(sent.size());
          piece.set_origin(other);
        }
        piece.set_offset(off);
        piece.set_data(sent.substr(off, n));
        piece.set_piece_xxh3(Checksum::Of(sent.data() + off, n) ^ (corrupt && off > 0 ? 1 : 0));
        mac.Update(sent.data() + off, n);
        off += n;
        piece.set_last(off == sent.size());
        if (piece.last() && c != kNoMac) {
          piece.set_image_mac(mac.Finish(PeerSecret::ImageBinding("PutShard", nonce, replica.job, replica.version,
                                                                  replica.rank, replica.session, other, sent.size())));
        }
        REQUIRE(writer->Write(piece));
      }
      writer->WritesDone();
      grpc::Status st = writer->Finish();
      auto kept = memory.Find(replica.job, replica.version, replica.rank);
      if (corrupt) {
        CHECK(st.error_code() == grpc::StatusCode::DATA_LOSS);
        CHECK(kept == nullptr);
      } else if (c != kRight) {
        CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
        CHECK_THAT(st.error_message(), Catch::Contains("MAC of --peer-secret"));
        CHECK(kept == nullptr);
      } else {
        REQUIRE(st.ok());
        CHECK(reply.bytes_held() > 0);
        REQUIRE(kept);
        CHECK(std::string(kept->data(), kept->file_bytes) == sent);
        // The acknowledgement proves the receiver knows the secret.
        const auto& md = ctx.GetServerTrailingMetadata();
        auto proof = md.find(PeerSecret::kProofKey);
        REQUIRE(proof != md.end());
        CHECK(secret
                  ->CheckProof(std::string(proof->second.data(), proof->second.size()), "PutShard", nonce,
                               subject + " kept " + std::to_string(reply.bytes_held()))
                  .ok());
      }
    }
  }
}
