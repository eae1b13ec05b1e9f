// The shard stream: a shard image (MemoryImage, a ckptd shard's safetensors file) as the
// stream of ShardPieces that the Peer service's PutShard and GetShard carry (peer.proto).
//
// Out (SendImage): pieces of a given size, the first holding the whole header, each
// referencing the image's memory rather than copying it (piece_wire.h's EncodePiece), with
// its xxh3-64 if asked, the last carrying the MAC of --peer-secret over every byte and the
// transfer's binding (PeerSecret::ImageBinding).
// In (ReceiveImage): the pieces in order into an image that the caller allocates once the
// header is known (in the first piece, read through a buffer of its own); every later byte is
// copied once, straight into the image. The order and sizes, the header, the piece
// checksums (if asked) and the MAC are checked on the way; a stream that fails a check gives
// an error and no image.
//
// Deltas (PutShard only; peer.proto's ShardPiece.base_version): the sender, which knows the
// item table of a version B the receiver acknowledged, sends the header and the items that
// are not the same in B (DeltaRanges; the same: equal name, file offset, length and
// checksum); the receiver takes the rest from its replica of B (ReceiveImage's FindBase),
// after checking that every byte it did not receive lies in such an item, and that those
// items' bytes, once copied, still match their checksums.
//
// Stateless functions; each call works on its own stream and image: safe from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/base/peer_secret.h"
#include "daemon/replication/piece_wire.h"
#include "daemon/tiers/memory_tier.h"
#include "format/shard_format.h"

namespace ckpt {

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

// A byte range of a shard image: [offset, offset + bytes).
struct ByteRange {
  std::uint64_t offset = 0, bytes = 0;
};

// An item as a delta compares it: its name, absolute file offset, length and checksum.
struct ItemSpan {
  std::string name;
  std::uint64_t offset = 0, length = 0, checksum = 0;
};
// The items of a parsed header, in file order, with absolute offsets.
std::vector<ItemSpan> ItemSpans(const ShardInfo& info);
// The parsed header of a complete image (DataLoss if it has none that parses).
Result<ShardInfo> ImageHeader(const MemoryImage& image);

// What SendImage sends: the whole image (base_version 0), or a delta on base_version:
// `ranges`, in increasing order, not touching, the first starting at 0 and holding the
// whole header.
struct DeltaPlan {
  std::uint64_t base_version = 0;
  std::vector<ByteRange> ranges;
  std::uint64_t bytes() const;  // the bytes the ranges hold
};
// The ranges of an image whose header ends at `header_end`, with items `now`, to send as a
// delta on a version with items `base`: the header and every item of non-zero length that
// `base` has no same item of (same name, offset, length and checksum). Empty when no such
// item is the same: then a delta saves nothing, and the whole image goes.
std::vector<ByteRange> DeltaRanges(std::uint64_t header_end, const std::vector<ItemSpan>& now,
                                   const std::vector<ItemSpan>& base);

// Reads the stream's next piece into *buffer; false at the end of the stream.
using NextPiece = std::function<bool(grpc::ByteBuffer* buffer)>;
// The image to receive the shard `meta` of `file_bytes` into, or null with *refusal saying
// why (no room, for one).
using MakeImage =
    std::function<std::shared_ptr<MemoryImage>(const ShardMeta& meta, std::uint64_t file_bytes, std::string* refusal)>;
// The base of a delta on `base_version`: the complete image of that version of the same
// (job, rank) that the receiver holds from the same origin, or null with *refusal saying why.
using FindBase = std::function<std::shared_ptr<MemoryImage>(std::uint64_t base_version, std::string* refusal)>;
// Sends one piece carrying `data_bytes` of the image; false if the stream is broken.
using WritePiece = std::function<bool(const grpc::ByteBuffer& piece, std::uint64_t data_bytes)>;

// The pieces `first` (already read) and then those from `next` as a shard image, made by
// `make` once the first piece (with the whole header) is there: ResourceExhausted with its
// refusal if it makes none. Checks the pieces' order and sizes and the header (against
// `want` when it names a shard: DataLoss if another came), with PieceSums::kChecked every
// piece's checksum (DataLoss), and the image's MAC as `check` says: PermissionDenied if it is
// not right, and the image is not returned (no byte of it is used). *received (if given) grows
// by the bytes received, whatever the outcome.
// A delta (the first piece names a base_version) needs `find_base`: without it, or when it
// finds no base, FailedPrecondition (the sender then sends the whole image). Its pieces may
// skip bytes; once the MAC checks, every byte not received must lie in an item of the image's
// header that the base's header has the same (name, offset, length, checksum), else DataLoss;
// those bytes are copied from the base, and an item so composed that fails its checksum (the
// base's copy is not what its header says) is FailedPrecondition. No image on any failure.
Result<std::shared_ptr<MemoryImage>> ReceiveImage(const WirePiece& first, const NextPiece& next, const MakeImage& make,
                                                  const v1::ShardKey& want, PieceSums sums, const ImageCheck& check,
                                                  std::uint64_t* received, const FindBase& find_base = nullptr);

// Streams `image` through `write` in pieces of `piece` bytes (the first holding the whole
// header, and naming the shard and `origin`), each referencing the image's memory (the image
// stays alive until gRPC has sent it), with its xxh3-64 when `sums` is kChecked, and on the
// last piece `mac` of every byte and `binding`. `pace` (if set) runs before every piece.
// With a `delta` whose base_version is set, only its ranges go (in pieces of at most `piece`
// bytes, the first holding the header), the first piece names the base, and each piece's
// offset and length go into the MAC before its bytes; `binding` must name the base too.
// False if a write failed (the rest is not sent).
bool SendImage(const std::shared_ptr<MemoryImage>& image, const std::string& origin, std::uint64_t piece,
               PieceSums sums, PeerSecret::ImageMac mac, const std::string& binding, const WritePiece& write,
               const std::function<void()>& pace, const DeltaPlan& delta = {});

// A buffer outside the memory tier's budget, for an image fetched or rebuilt only to be
// restored; null if it cannot be mapped.
std::shared_ptr<MemoryImage> StandaloneImage(const ShardMeta& meta, std::uint64_t file_bytes);

}  // namespace ckpt
