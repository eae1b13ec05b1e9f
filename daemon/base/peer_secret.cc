#include "daemon/base/peer_secret.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/hmac.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "common/safe_file.h"

namespace ckpt {
namespace {

std::string Hex(const unsigned char* p, std::size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    out += kDigits[p[i] >> 4];
    out += kDigits[p[i] & 15];
  }
  return out;
}

std::int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Result<PeerSecret> PeerSecret::Load(const std::string& path) {
  auto fd = OpenRegularForRead(path);
  if (!fd.ok()) return InvalidArgument("--peer-secret " + path + ": " + fd.status().message());
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) return InvalidArgument("--peer-secret " + path + ": " + std::strerror(errno));
  if (st.st_uid != ::geteuid()) {
    return InvalidArgument("--peer-secret " + path + " is owned by uid " + std::to_string(st.st_uid) +
                           ", not by the daemon's uid " + std::to_string(::geteuid()));
  }
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return InvalidArgument("--peer-secret " + path + " is mode " + mode +
                           ": others may read it; make it readable by the daemon's user only (chmod 600)");
  }
  std::string key;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd->get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return InvalidArgument("--peer-secret " + path + ": " + std::strerror(errno));
    if (n == 0) break;
    key.append(buf, static_cast<std::size_t>(n));
    if (key.size() > 65536) return InvalidArgument("--peer-secret " + path + " is larger than 64 KiB");
  }
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
  if (key.size() < 16) {
    return InvalidArgument("--peer-secret " + path + " holds " + std::to_string(key.size()) +
                           " bytes; a secret needs at least 16 (e.g. head -c 32 /dev/urandom | base64)");
  }
  return PeerSecret(std::move(key));
}

std::string PeerSecret::Mac(const std::string& text) const {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()), reinterpret_cast<const unsigned char*>(text.data()),
       text.size(), out, &len);
  return Hex(out, len);
}

// The nonces of the tokens accepted in the last 2 x kSkew (a token older than kSkew is
// refused by its time, so one seen before that cannot come back).
class PeerSecret::Nonces {
 public:
  // False if `nonce` was seen already; else remembers it until `unix_ms` + 2 x kSkew.
  bool FirstTime(const std::string& nonce, std::int64_t unix_ms) {
    const std::int64_t now = NowMs(), keep = 2 * kSkew.count() * 1000;
    std::lock_guard<std::mutex> lock(mu_);
    // Forget the expired ones, oldest first.
    while (!by_time_.empty() && by_time_.begin()->first < now - keep) {
      seen_.erase(by_time_.begin()->second);
      by_time_.erase(by_time_.begin());
    }
    if (!seen_.emplace(nonce, unix_ms).second) return false;
    by_time_.emplace(std::max(unix_ms, now - keep / 2), nonce);
    return true;
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::int64_t> seen_;
  std::multimap<std::int64_t, std::string> by_time_;
};

PeerSecret::PeerSecret() : seen_(std::make_shared<Nonces>()) {}
PeerSecret::PeerSecret(std::string key) : key_(std::move(key)), seen_(std::make_shared<Nonces>()) {}

std::string PeerSecret::ShardSubject(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                     const std::string& origin) {
  return job + " " + std::to_string(version) + " " + std::to_string(rank) + " " + origin;
}

std::string PeerSecret::Addressed(const std::string& subject, const std::string& callee) {
  return subject + " to " + callee;
}

std::string PeerSecret::JobSubject(const std::string& job, const std::string& origin) { return job + " " + origin; }

std::string PeerSecret::Token(const std::string& call, const std::string& subject) const {
  return TokenAt(call, subject, NowMs());
}

std::string PeerSecret::TokenAt(const std::string& call, const std::string& subject, std::int64_t unix_ms) const {
  unsigned char nonce[8];
  if (RAND_bytes(nonce, sizeof nonce) != 1) {
    const auto t = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::memcpy(nonce, &t, sizeof nonce);
  }
  const std::string ms = std::to_string(unix_ms);
  const std::string n = Hex(nonce, sizeof nonce);
  return "v2 " + ms + " " + n + " " + Mac("ckptd-peer/v3 call " + call + " " + subject + " " + ms + " " + n);
}

std::string PeerSecret::NonceOf(const std::string& token) {
  std::istringstream in(token);
  std::string v, ms, nonce;
  in >> v >> ms >> nonce;
  return v == "v2" && nonce.size() == 16 ? nonce : std::string();
}

std::string PeerSecret::Proof(const std::string& call, const std::string& nonce, const std::string& answer) const {
  return Mac("ckptd-peer/v3 reply " + call + " " + nonce + " " + answer);
}

Status PeerSecret::CheckProof(const std::string& proof, const std::string& call, const std::string& nonce,
                              const std::string& answer) const {
  const std::string want = Proof(call, nonce, answer);
  if (nonce.empty() || proof.size() != want.size() || CRYPTO_memcmp(want.data(), proof.data(), want.size()) != 0) {
    return PermissionDenied(std::string("its ") + call + " reply " +
                            (proof.empty() ? "carries no " : "carries a wrong ") + kProofKey +
                            ": it did not prove it knows --peer-secret (not a ckptd of this cluster, or one "
                            "of an older release), so nothing it answered is believed");
  }
  return Status::Ok();
}

struct PeerSecret::ImageMac::Ctx {
  EVP_MAC_CTX* mac = nullptr;
  ~Ctx() { EVP_MAC_CTX_free(mac); }
};

PeerSecret::ImageMac::ImageMac(std::unique_ptr<Ctx> ctx) : ctx_(std::move(ctx)) {}
PeerSecret::ImageMac::ImageMac(ImageMac&&) noexcept = default;
PeerSecret::ImageMac& PeerSecret::ImageMac::operator=(ImageMac&&) noexcept = default;
PeerSecret::ImageMac::~ImageMac() = default;

void PeerSecret::ImageMac::Update(const char* data, std::size_t n) {
  if (ctx_ && ctx_->mac && n > 0 && EVP_MAC_update(ctx_->mac, reinterpret_cast<const unsigned char*>(data), n) != 1)
    ctx_.reset();
}

std::string PeerSecret::ImageMac::Finish(const std::string& binding) {
  Update(binding.data(), binding.size());
  unsigned char out[EVP_MAX_MD_SIZE];
  std::size_t len = 0;
  if (!ctx_ || !ctx_->mac || EVP_MAC_final(ctx_->mac, out, &len, sizeof out) != 1 || len != kMacBytes) {
    ctx_.reset();
    return {};
  }
  ctx_.reset();
  return std::string(reinterpret_cast<const char*>(out), len);
}

PeerSecret::ImageMac PeerSecret::StartImage() const {
  // The algorithm is fetched once; each image has a context of its own.
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  auto ctx = std::make_unique<ImageMac::Ctx>();
  if (hmac != nullptr) ctx->mac = EVP_MAC_CTX_new(hmac);
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
  if (ctx->mac != nullptr &&
      EVP_MAC_init(ctx->mac, reinterpret_cast<const unsigned char*>(key_.data()), key_.size(), params) != 1) {
    EVP_MAC_CTX_free(ctx->mac);
    ctx->mac = nullptr;
  }
  return ImageMac(std::move(ctx));
}

std::string PeerSecret::ImageBinding(const std::string& call, const std::string& nonce, const std::string& job,
                                     std::uint64_t version, std::uint32_t rank, const std::string& registration,
                                     const std::string& origin, std::uint64_t file_bytes,
                                     std::uint64_t base_version) {
  // Every string length-prefixed: no two bindings read alike. A whole image's binding ends
  // in a digit, a delta's in " delta": read from its end (the bytes before it are the
  // image's), neither is the other, and the base is the number before " delta".
  auto field = [](const std::string& s) { return std::to_string(s.size()) + ":" + s; };
  std::string binding = "\nckptd-peer/v3 image " + field(call) + " " + field(nonce) + " " + field(job) + " " +
                        std::to_string(version) + " " + std::to_string(rank) + " " + field(registration) + " " +
                        field(origin) + " " + std::to_string(file_bytes);
  if (base_version != 0) binding += " base " + std::to_string(base_version) + " delta";
  return binding;
}

std::string PeerSecret::PutAnswer(const std::string& subject, std::uint64_t bytes_held) {
  return subject + " kept " + std::to_string(bytes_held);
}

std::string PeerSecret::HasAnswer(const std::string& subject, bool held, std::uint64_t file_bytes,
                                  const std::string& registration) {
  return subject + " held " + (held ? "1 " : "0 ") + std::to_string(file_bytes) + " " +
         std::to_string(registration.size()) + ":" + registration;
}

std::string PeerSecret::DropAnswer(const std::string& subject, std::uint32_t dropped,
                                   std::uint64_t bytes_held) {
  return subject + " dropped " + std::to_string(dropped) + " holding " + std::to_string(bytes_held);
}

bool PeerSecret::SameMac(const std::string& a, const std::string& b) {
  return !a.empty() && a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Status PeerSecret::Check(const std::string& token, const std::string& call, const std::string& subject) const {
  std::istringstream in(token);
  std::string v, ms, nonce, mac;
  in >> v >> ms >> nonce >> mac;
  if (v == "v1") {
    return PermissionDenied("peer call " + call + " with a token of an older ckptd release (" + kMetadataKey +
                            " v1, whose replies prove nothing): every daemon of --peers must run the same release");
  }
  if (v != "v2" || ms.empty() || nonce.size() != 16 || mac.size() != 64) {
    return PermissionDenied("peer call " + call + " without a valid " + kMetadataKey +
                            " token: the caller does not share this daemon's --peer-secret");
  }
  const std::string want = Mac("ckptd-peer/v3 call " + call + " " + subject + " " + ms + " " + nonce);
  if (CRYPTO_memcmp(want.data(), mac.data(), want.size()) != 0) {
    return PermissionDenied("peer call " + call + " (" + subject +
                            ") refused: its token was not made with this daemon's --peer-secret for this request");
  }
  std::int64_t when = 0;
  try {
    when = std::stoll(ms);
  } catch (...) {
    return PermissionDenied("peer call " + call + ": malformed token time");
  }
  const std::int64_t skew = NowMs() - when;
  if (skew > kSkew.count() * 1000 || -skew > kSkew.count() * 1000) {
    return PermissionDenied("peer call " + call + " refused: its token is " + std::to_string(skew / 1000) +
                            " s off this daemon's clock (at most " + std::to_string(kSkew.count()) + " s)");
  }
  if (!seen_->FirstTime(nonce, when)) {
    return PermissionDenied("peer call " + call + " (" + subject + ") refused: its token was used before (a replay)");
  }
  return Status::Ok();
}

}  // namespace ckpt
