// Fuzz target: the hand-written reader of the peer protocol's ShardPiece
// (daemon/replication/piece_wire.h WirePiece::Parse, CopyData). Its input comes from the
// network: from whatever listens on a peer's address, or connects to this daemon's peer port
// (a first piece is parsed before the image's MAC can be checked).
//
// The first byte chooses how the rest is cut into slices (as TCP reads arrive). Invariants:
// a piece the reader accepts, protobuf parses too, to the same fields and the same `data`
// (any protobuf peer writes and reads the same bytes); `data` lies inside the input; the
// copy reads no byte outside it.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/v1/peer.pb.h"
#include "daemon/replication/piece_wire.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t step = 1 + data[0] % 64;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::vector<grpc::Slice> slices;
  for (std::size_t at = 0; at < bytes.size(); at += step) {
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  auto piece = ckpt::WirePiece::Parse(buffer);
  if (!piece.ok()) {
    FUZZ_CHECK(piece.status().code() == ckpt::StatusCode::kDataLoss, "a malformed piece is DataLoss");
    return 0;
  }
  FUZZ_CHECK(piece->data_bytes() <= bytes.size(), "data lies inside the piece");
  std::string copied(piece->data_bytes(), '\0');
  ckpt::Checksum sum;
  piece->CopyData(copied.data(), &sum);
  FUZZ_CHECK(sum.Digest() == ckpt::Checksum::Of(copied.data(), copied.size()), "the checksum is of the bytes copied");
  ckpt::v1::ShardPiece parsed;
  FUZZ_CHECK(parsed.ParseFromString(bytes), "protobuf parses what the reader accepts");
  const ckpt::v1::ShardPiece& f = piece->fields();
  FUZZ_CHECK(parsed.data() == copied, "the same data");
  FUZZ_CHECK(parsed.offset() == f.offset() && parsed.file_bytes() == f.file_bytes() && parsed.last() == f.last() &&
                 parsed.piece_xxh3() == f.piece_xxh3() && parsed.base_version() == f.base_version(),
             "the same numbers");
  FUZZ_CHECK(parsed.origin() == f.origin() && parsed.image_mac() == f.image_mac(), "the same strings");
  FUZZ_CHECK(parsed.key().SerializeAsString() == f.key().SerializeAsString(), "the same key");
  FUZZ_CHECK(f.data().empty(), "data is not copied into the fields");
  return 0;
}
