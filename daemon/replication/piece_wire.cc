#include "daemon/replication/piece_wire.h"

#include <google/protobuf/stubs/common.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace ckpt {
namespace {

// Protobuf's wire types and the ShardPiece fields read here (peer.proto).
constexpr std::uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr std::uint32_t kKey = 1, kFileBytes = 2, kOrigin = 3, kOffset = 4, kData = 5, kPieceXxh3 = 6, kLast = 8,
                        kImageMac = 9, kBaseVersion = 10;
// The longest `image_mac` read (an HMAC-SHA256 is 32 bytes; anything longer is refused).
constexpr std::uint64_t kMaxImageMac = 64;

void AppendVarint(std::string* out, std::uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Reads protobuf's encoding across the slices of one message.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) left_ += s.size();
    Normalize();
  }
  std::uint64_t left() const { return left_; }
  std::size_t slice() const { return i_; }
  std::size_t pos() const { return pos_; }

  bool Varint(std::uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (left_ == 0) return false;
      const auto b = static_cast<std::uint8_t>(slices_[i_].begin()[pos_]);
      Advance(1);
      *v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // longer than 10 bytes
  }
  bool Fixed64(std::uint64_t* v) {
    unsigned char b[8];
    if (!Copy(8, reinterpret_cast<char*>(b), nullptr)) return false;
    *v = 0;
    for (int k = 7; k >= 0; --k) *v = (*v << 8) | b[k];
    return true;
  }
  // Copies (dst not null) or skips n bytes; feeds them to `sum` when not null.
  bool Copy(std::uint64_t n, char* dst, Checksum* sum) {
    if (n > left_) return false;
    while (n > 0) {
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, slices_[i_].size() - pos_));
      const auto* src = reinterpret_cast<const char*>(slices_[i_].begin()) + pos_;
      if (dst) {
        std::memcpy(dst, src, take);
        dst += take;
      }
      if (sum) sum->Update(src, take);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(std::size_t n) {
    pos_ += n;
    left_ -= n;
    Normalize();
  }
  void Normalize() {
    while (i_ < slices_.size() && pos_ == slices_[i_].size()) {
      ++i_;
      pos_ = 0;
    }
  }
  const std::vector<grpc::Slice>& slices_;
  std::size_t i_ = 0, pos_ = 0;
  std::uint64_t left_ = 0;
};

Status Malformed(const std::string& what) { return DataLoss("a malformed ShardPiece from the peer: " + what); }

}  // namespace

grpc::ByteBuffer EncodePiece(const v1::ShardPiece& fields, std::shared_ptr<const void> owner, const char* data,
                             std::size_t n) {
  // Field order does not matter to a protobuf reader; `data` last lets WirePiece know the
  // piece's offset before its bytes (it does not depend on that).
  std::string head = fields.SerializeAsString();
  AppendVarint(&head, (kData << 3) | kLengthDelimited);
  AppendVarint(&head, n);
  auto* keep = new std::shared_ptr<const void>(std::move(owner));  // deleted by the slice's release
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      grpc::Slice(const_cast<char*>(data), n,
                  [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, keep),
  };
  return grpc::ByteBuffer(slices, 2);
}

Result<WirePiece> WirePiece::Parse(const grpc::ByteBuffer& buffer) {
  WirePiece p;
  if (grpc::Status st = buffer.Dump(&p.slices_); !st.ok()) return Malformed(st.error_message());
  SliceCursor in(p.slices_);
  bool data_seen = false;
  while (in.left() > 0) {
    std::uint64_t tag = 0;
    if (!in.Varint(&tag) || tag > 0xffffffffu || (tag >> 3) == 0) return Malformed("a bad field tag");
    const auto field = static_cast<std::uint32_t>(tag >> 3);
    const auto type = static_cast<std::uint32_t>(tag & 7);
    std::uint64_t v = 0;
    bool ok = true;
    if (field == kKey && type == kLengthDelimited) {
      std::string bytes;
      ok = in.Varint(&v) && v <= in.left();
      if (ok) {
        bytes.resize(v);
        ok = in.Copy(v, bytes.data(), nullptr) && p.fields_.mutable_key()->MergeFromString(bytes);
      }
    } else if (field == kOrigin && type == kLengthDelimited) {
      ok = in.Varint(&v) && v <= in.left();
      if (ok) {
        std::string* origin = p.fields_.mutable_origin();
        origin->resize(v);
        ok = in.Copy(v, origin->data(), nullptr);
        // A proto3 string: what protobuf would refuse is refused here too.
        if (ok && !google::protobuf::internal::IsStructurallyValidUTF8(origin->data(), static_cast<int>(v))) {
          return Malformed("`origin` is not UTF-8");
        }
      }
    } else if (field == kData && type == kLengthDelimited) {
      if (data_seen) return Malformed("`data` twice");
      data_seen = true;
      ok = in.Varint(&v) && v <= in.left();
      if (ok) {
        p.data_slice_ = in.slice();
        p.data_pos_ = in.pos();
        p.data_bytes_ = v;
        ok = in.Copy(v, nullptr, nullptr);
      }
    } else if (field == kImageMac && type == kLengthDelimited) {
      ok = in.Varint(&v) && v <= kMaxImageMac && v <= in.left();
      if (ok) {
        p.fields_.mutable_image_mac()->resize(v);
        ok = in.Copy(v, p.fields_.mutable_image_mac()->data(), nullptr);
      }
    } else if (field == kFileBytes && type == kVarint) {
      ok = in.Varint(&v);
      p.fields_.set_file_bytes(v);
    } else if (field == kOffset && type == kVarint) {
      ok = in.Varint(&v);
      p.fields_.set_offset(v);
    } else if (field == kPieceXxh3 && type == kFixed64) {
      ok = in.Fixed64(&v);
      p.fields_.set_piece_xxh3(v);
    } else if (field == kLast && type == kVarint) {
      ok = in.Varint(&v);
      p.fields_.set_last(v != 0);
    } else if (field == kBaseVersion && type == kVarint) {
      ok = in.Varint(&v);
      p.fields_.set_base_version(v);
    } else if (field == kKey || field == kOrigin || field == kData || field == kFileBytes || field == kOffset ||
               field == kPieceXxh3 || field == kLast || field == kImageMac || field == kBaseVersion) {
      return Malformed("field " + std::to_string(field) + " with wire type " + std::to_string(type));
    } else if (type == kVarint) {  // a field this daemon does not know (a newer peer's): skipped
      ok = in.Varint(&v);
    } else if (type == kFixed64) {
      ok = in.Copy(8, nullptr, nullptr);
    } else if (type == kFixed32) {
      ok = in.Copy(4, nullptr, nullptr);
    } else if (type == kLengthDelimited) {
      ok = in.Varint(&v) && in.Copy(v, nullptr, nullptr);
    } else {
      return Malformed("wire type " + std::to_string(type));
    }
    if (!ok) return Malformed("it ends inside field " + std::to_string(field));
  }
  return p;
}

void WirePiece::CopyData(char* dst, Checksum* sum, PeerSecret::ImageMac* mac) const {
  std::uint64_t n = data_bytes_;
  std::size_t i = data_slice_, pos = data_pos_;
  while (n > 0) {
    const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, slices_[i].size() - pos));
    const auto* src = reinterpret_cast<const char*>(slices_[i].begin()) + pos;
    // Each slice is checked from the copy just written, while it is in the cache.
    std::memcpy(dst, src, take);
    if (sum) sum->Update(dst, take);
    if (mac) mac->Update(dst, take);
    dst += take;
    n -= take;
    ++i;
    pos = 0;
  }
}

}  // namespace ckpt
