// A ShardPiece without protobuf's copies (issue 17, daemon/replication/piece_wire.*): what
// EncodePiece writes is a ShardPiece to protobuf, what protobuf writes WirePiece reads, in
// however many slices the bytes arrive, and a piece that is not well formed is refused.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "daemon/replication/piece_wire.h"
#include "format/checksum.h"

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
