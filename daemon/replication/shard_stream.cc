#include "daemon/replication/shard_stream.h"

#include <algorithm>
#include <cstring>
#include <map>

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

bool SameItem(const ItemSpan& a, const ItemSpan& b) {
  return a.name == b.name && a.offset == b.offset && a.length == b.length && a.checksum == b.checksum;
}

// Completes a delta's `image` of `file_bytes` (`sent`: the ranges received, in order) from
// `base`: see ReceiveImage.
Status ComposeFromBase(const ShardInfo& info, const std::vector<ByteRange>& sent, const MemoryImage& base,
                       std::uint64_t base_version, MemoryImage& image, std::uint64_t file_bytes) {
  auto base_info = ImageHeader(base);
  if (!base_info.ok()) {
    return FailedPrecondition("the replica of base version " + std::to_string(base_version) +
                              " has no readable header: " + base_info.status().message());
  }
  std::map<std::string, ItemSpan> base_items;
  for (ItemSpan& item : ItemSpans(base_info.value())) base_items.emplace(item.name, std::move(item));
  // Whether [a, b) lies in the ranges received.
  auto all_sent = [&sent](std::uint64_t a, std::uint64_t b) {
    auto it = std::upper_bound(sent.begin(), sent.end(), a,
                               [](std::uint64_t x, const ByteRange& r) { return x < r.offset; });
    if (it == sent.begin()) return false;
    --it;
    return a >= it->offset && b <= it->offset + it->bytes;
  };
  // The items taken from the base, in file order: each the same in both headers.
  std::vector<ItemSpan> taken;
  for (const ItemSpan& item : ItemSpans(info)) {
    if (item.length == 0 || all_sent(item.offset, item.offset + item.length)) continue;
    auto b = base_items.find(item.name);
    if (b == base_items.end() || !SameItem(item, b->second)) {
      return DataLoss("the delta did not send all of item '" + item.name + "', and the replica of base version " +
                      std::to_string(base_version) +
                      " holds no item of that name at the same offset with the same length and checksum");
    }
    taken.push_back(item);
  }
  // The coverage map: every byte not received lies in a taken item, or the image is refused.
  std::vector<ByteRange> gaps;
  std::uint64_t at = 0;
  for (const ByteRange& r : sent) {
    if (r.offset > at) gaps.push_back({at, r.offset - at});
    at = r.offset + r.bytes;
  }
  if (at < file_bytes) gaps.push_back({at, file_bytes - at});
  std::size_t t = 0;
  for (const ByteRange& g : gaps) {
    std::uint64_t from = g.offset;
    const std::uint64_t to = g.offset + g.bytes;
    while (from < to) {
      while (t < taken.size() && taken[t].offset + taken[t].length <= from) ++t;
      if (t == taken.size() || taken[t].offset > from) {
        return DataLoss("bytes " + std::to_string(from) + " to " + std::to_string(to) + " of the image were neither "
                        "sent nor in an item the replica of base version " + std::to_string(base_version) +
                        " holds the same: the delta does not make a whole image");
      }
      from = std::min(to, taken[t].offset + taken[t].length);
    }
    // In the base's file too: its header has the same items at the same offsets.
    std::memcpy(image.data() + g.offset, base.data() + g.offset, g.bytes);
  }
  // The base's bytes are what its header says only if nothing changed them since they were
  // checked: each item composed is checked again before the image counts.
  for (const ItemSpan& item : taken) {
    if (Checksum::Of(image.data() + item.offset, item.length) != item.checksum) {
      return FailedPrecondition("item '" + item.name + "' composed from the replica of base version " +
                                std::to_string(base_version) + " fails its checksum: the whole image is needed");
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<ItemSpan> ItemSpans(const ShardInfo& info) {
  std::vector<ItemSpan> out;
  out.reserve(info.items.size());
  for (const ShardItem& item : info.items) {
    out.push_back(ItemSpan{item.name, info.data_start + item.offset, item.length, item.checksum});
  }
  return out;
}

Result<ShardInfo> ImageHeader(const MemoryImage& image) {
  const std::uint64_t header_end = HeaderEnd(image.data(), image.file_bytes);
  if (header_end < 8 || header_end - 8 > kMaxShardHeader) return DataLoss("the image has no shard header");
  return ParseShardHeader(std::string_view(image.data() + 8, header_end - 8), image.file_bytes);
}

std::uint64_t DeltaPlan::bytes() const {
  std::uint64_t n = 0;
  for (const ByteRange& r : ranges) n += r.bytes;
  return n;
}

std::vector<ByteRange> DeltaRanges(std::uint64_t header_end, const std::vector<ItemSpan>& now,
                                   const std::vector<ItemSpan>& base) {
  std::map<std::string, const ItemSpan*> by_name;
  for (const ItemSpan& item : base) by_name.emplace(item.name, &item);
  std::vector<ByteRange> ranges{{0, header_end}};
  bool any_same = false;
  for (const ItemSpan& item : now) {
    if (item.length == 0) continue;
    auto b = by_name.find(item.name);
    if (b != by_name.end() && SameItem(item, *b->second)) {
      any_same = true;
      continue;
    }
    ByteRange& last = ranges.back();
    if (last.offset + last.bytes == item.offset) {
      last.bytes += item.length;
    } else {
      ranges.push_back({item.offset, item.length});
    }
  }
  if (!any_same) return {};
  return ranges;
}

Result<std::shared_ptr<MemoryImage>> ReceiveImage(const WirePiece& first, const NextPiece& next, const MakeImage& make,
                                                  const v1::ShardKey& want, PieceSums sums, const ImageCheck& check,
                                                  std::uint64_t* received, const FindBase& find_base) {
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
  const std::uint64_t base_version = head.base_version();
  {
    Checksum sum;
    // A whole image's MAC grows piece by piece; a delta's is taken over the image composed.
    first.CopyData(data.data(), sums == PieceSums::kChecked ? &sum : nullptr, base_version == 0 ? &mac : nullptr);
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
  // A delta's base, found before the image is made: held here, it stays whole even if making
  // room for the image drops it from the tier.
  std::shared_ptr<MemoryImage> base;
  if (base_version != 0) {
    if (base_version >= key.version()) {
      return DataLoss("a delta of version " + std::to_string(key.version()) + " on version " +
                      std::to_string(base_version) + ": a base must be older");
    }
    std::string why = "this stream takes whole images only";
    if (find_base) base = find_base(base_version, &why);
    if (!base) {
      return FailedPrecondition("cannot take " + DescribeShard(key.job(), key.version(), key.rank()) +
                                " as a delta on version " + std::to_string(base_version) + ": " + why);
    }
    if (base->meta.session != meta.session) {
      return FailedPrecondition("the replica of base version " + std::to_string(base_version) +
                                " was written by another registration than version " + std::to_string(key.version()));
    }
  }
  std::string refusal;
  std::shared_ptr<MemoryImage> image = make(meta, file_bytes, &refusal);
  if (!image && base) {
    // Beside a base held here, the room it would give back is not to be had: the whole
    // image, which needs no base, may still fit.
    return FailedPrecondition("no room for " + DescribeShard(key.job(), key.version(), key.rank()) +
                              " beside its base version " + std::to_string(base_version) + ": " + refusal);
  }
  if (!image) return ResourceExhausted(refusal);
  std::memcpy(image->data(), data.data(), data.size());
  std::uint64_t done = data.size();
  if (received) *received += done;
  std::vector<ByteRange> sent{{0, done}};  // the ranges received, in order
  bool last = head.last();
  std::string mac_sent = head.image_mac();
  while (!last) {
    grpc::ByteBuffer buffer;
    if (!next(&buffer)) break;
    auto parsed = WirePiece::Parse(buffer);
    if (!parsed.ok()) return parsed.status();
    const WirePiece& piece = parsed.value();
    const std::uint64_t n = piece.data_bytes();
    const std::uint64_t at = piece.fields().offset();
    // A whole image's pieces follow each other; a delta's may skip bytes, never go back.
    const bool in_order = base ? at >= done && n > 0 : at == done;
    if (!in_order || at > file_bytes || n > file_bytes - at) {
      return DataLoss("piece at offset " + std::to_string(at) + " (" + std::to_string(n) + " bytes) does not follow byte " +
                      std::to_string(done) + " of " + std::to_string(file_bytes));
    }
    // Straight into the image: the one copy of these bytes on this side.
    Checksum sum;
    piece.CopyData(image->data() + at, sums == PieceSums::kChecked ? &sum : nullptr, base ? nullptr : &mac);
    if (sums == PieceSums::kChecked && sum.Digest() != piece.fields().piece_xxh3()) {
      return DataLoss("the piece at offset " + std::to_string(at) + " failed its checksum on arrival");
    }
    if (at == done) {
      sent.back().bytes += n;
    } else {
      sent.push_back({at, n});
    }
    done = at + n;
    if (received) *received += n;
    last = piece.fields().last();
    if (last) mac_sent = piece.fields().image_mac();
  }
  if (!last || (!base && done != file_bytes)) {
    return DataLoss("the stream ended after " + std::to_string(done) + " of " + std::to_string(file_bytes) + " bytes");
  }
  if (base) {
    if (Status st = ComposeFromBase(info.value(), sent, *base, base_version, *image, file_bytes); !st.ok()) return st;
    // The MAC covers every byte of the image composed, those taken from the base included:
    // the replica kept is the sender's image, not merely one whose item checksums agree.
    mac.Update(image->data(), file_bytes);
  }
  const std::string binding = PeerSecret::ImageBinding(check.call, check.nonce, meta.job, meta.version, meta.rank,
                                                       meta.session, head.origin(), file_bytes, base_version);
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
               const std::function<void()>& pace, const DeltaPlan& delta) {
  const std::uint64_t file_bytes = image->file_bytes;
  const std::uint64_t header_end = HeaderEnd(image->data(), file_bytes);
  const bool is_delta = delta.base_version != 0;
  const std::vector<ByteRange> whole{{0, file_bytes}};
  const std::vector<ByteRange>& ranges = is_delta ? delta.ranges : whole;
  // A delta's MAC is of the whole image, bytes not sent included (the receiver takes it over
  // the image it composes); a whole image's grows as its pieces go.
  std::string delta_mac;
  if (is_delta) {
    mac.Update(image->data(), file_bytes);
    delta_mac = mac.Finish(binding);
  }
  bool first = true;
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    std::uint64_t off = ranges[r].offset;
    const std::uint64_t end = off + ranges[r].bytes;
    do {
      std::uint64_t n = std::min<std::uint64_t>(piece, end - off);
      if (first) n = std::min<std::uint64_t>(std::max<std::uint64_t>(n, header_end), end - off);
      if (pace) pace();
      v1::ShardPiece fields;
      if (first) {
        auto* k = fields.mutable_key();
        k->set_job(image->meta.job);
        k->set_version(image->meta.version);
        k->set_rank(image->meta.rank);
        fields.set_file_bytes(file_bytes);
        fields.set_origin(origin);
        if (is_delta) fields.set_base_version(delta.base_version);
      }
      fields.set_offset(off);
      if (sums == PieceSums::kChecked) fields.set_piece_xxh3(Checksum::Of(image->data() + off, n));
      const char* data = image->data() + off;
      if (!is_delta) mac.Update(data, n);
      off += n;
      if (off == end && r + 1 == ranges.size()) {
        fields.set_last(true);
        fields.set_image_mac(is_delta ? delta_mac : mac.Finish(binding));
      }
      if (!write(EncodePiece(fields, image, data, n), n)) return false;
      first = false;
    } while (off < end);
  }
  return true;
}

}  // namespace ckpt
