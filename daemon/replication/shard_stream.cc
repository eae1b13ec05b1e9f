#include "daemon/replication/shard_stream.h"

#include <algorithm>
#include <cstring>

#include "ckpt/v1/peer.pb.h"
#include "daemon/replication/peer_protocol.h"
#include "format/checksum.h"
#include "format/shard_format.h"

namespace ckpt {
namespace {

// The 8-byte little-endian prefix of a safetensors file: the header's length.
std::uint64_t HeaderEnd(const char* data, std::uint64_t file_bytes) {
  if (file_bytes < 8) return file_bytes;
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[i]);
  return n > file_bytes - 8 ? file_bytes : 8 + n;
}

}  // namespace

Result<std::shared_ptr<MemoryImage>> ReceiveImage(const WirePiece& first, const NextPiece& next, const MakeImage& make,
                                                  const v1::ShardKey& want, PieceSums sums, const ImageCheck& check,
                                                  std::uint64_t* received) {
  const v1::ShardPiece& head = first.fields();
  const v1::ShardKey key = head.has_key() ? head.key() : want;
  if (Status st = CheckShardKey(key); !st.ok()) return st;
  if (want.job() != "" && (key.job() != want.job() || key.version() != want.version() || key.rank() != want.rank())) {
    return DataLoss("the peer sent " + DescribeShard(key.job(), key.version(), key.rank()) + ", not the shard asked for");
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
  if (header_end - 8 > kMaxShardHeader || data.size() < header_end) {
    return DataLoss("the first piece does not hold the whole shard header");
  }
  auto info = ParseShardHeader(std::string_view(data.data() + 8, header_end - 8), file_bytes);
  if (!info.ok()) return info.status().With("the replica's header");
  const ShardMeta& meta = info->meta;
  if (meta.job != key.job() || meta.version != key.version() || meta.rank != key.rank()) {
    return DataLoss("the replica's header holds " + DescribeShard(meta.job, meta.version, meta.rank) + ", not " +
                    DescribeShard(key.job(), key.version(), key.rank()));
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

bool SendImage(const std::shared_ptr<MemoryImage>& image, const std::string& origin, std::uint64_t piece,
               PieceSums sums, PeerSecret::ImageMac mac, const std::string& binding, const WritePiece& write,
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


}  // namespace ckpt
