// ShardPiece (proto/ckpt/v1/peer.proto) on the wire without protobuf's copies of `data`.
//
// A peer transfer moves whole shard images (GiBs). Through the generated code every piece's
// bytes were copied three times in user space: into the message's `bytes` field, from it
// into gRPC's send buffer, and on the other side out of the received buffer into a
// `bytes` field again, before the receiver copied them into the image. Here a piece is a
// grpc::ByteBuffer laid out exactly as protobuf would encode the ShardPiece (any protobuf
// reader parses it): the small fields serialized as usual, then field 5's tag and length,
// then a slice that points into the image itself and keeps its owner alive until gRPC has
// written it (EncodePiece). The reader (WirePiece) parses the fields from the received
// slices and copies `data` once, straight to where it goes, hashing it (xxh3, and the image's
// MAC) on the way if asked. A malformed piece (a peer's, or anyone's on its address) is
// DataLoss; tests/fuzz/shard_piece_fuzz.cc feeds the reader arbitrary bytes.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ckpt/v1/peer.pb.h"
#include "common/status.h"
#include "daemon/base/peer_secret.h"
#include "format/checksum.h"

namespace ckpt {

// The piece with `fields` (whose `data` must be empty) and `data` = [data, data + n), which
// `owner` keeps valid: the buffer references that memory, not a copy, and holds a reference
// to `owner` until gRPC lets the last slice go (possibly after the call that sent it).
grpc::ByteBuffer EncodePiece(const v1::ShardPiece& fields, std::shared_ptr<const void> owner, const char* data,
                             std::size_t n);

// A received piece: its fields, parsed, and where its data lies in the received slices.
class WirePiece {
 public:
  WirePiece() = default;
  // Takes `buffer`'s slices (no copy). DataLoss if they are not one well-formed ShardPiece.
  static Result<WirePiece> Parse(const grpc::ByteBuffer& buffer);

  // Every field but `data` (left empty).
  const v1::ShardPiece& fields() const { return fields_; }
  std::uint64_t data_bytes() const { return data_bytes_; }
  // Copies the data_bytes() bytes of `data` to `dst`; feeds them to `sum` and `mac` when not
  // null, slice by slice as they are copied (one pass over the bytes).
  void CopyData(char* dst, Checksum* sum, PeerSecret::ImageMac* mac = nullptr) const;

 private:
  std::vector<grpc::Slice> slices_;
  v1::ShardPiece fields_;
  std::size_t data_slice_ = 0;  // `data` starts in slices_[data_slice_] at data_pos_
  std::size_t data_pos_ = 0;
  std::uint64_t data_bytes_ = 0;
};

}  // namespace ckpt
