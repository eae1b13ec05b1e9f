// Fuzz target: the parser of COMMITTED (format/markers.h, ParseCommitted).
//
// Invariant: a marker that parses renders to a text that parses back to the same marker.
// The input is also read as the fields of a marker (job bytes after a 24-byte prefix), which
// must survive RenderCommitted and ParseCommitted whatever bytes the job holds.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "format/limits.h"
#include "format/markers.h"
#include "fuzz_check.h"

namespace {

bool Same(const ckpt::CommittedMarker& a, const ckpt::CommittedMarker& b) {
  return a.job == b.job && a.version == b.version && a.world_size == b.world_size &&
         a.committed_at == b.committed_at;
}

void CheckRoundTrip(const ckpt::CommittedMarker& m) {
  auto again = ckpt::ParseCommitted(ckpt::RenderCommitted(m));
  FUZZ_CHECK(again.ok(), again.status().message().c_str());
  FUZZ_CHECK(Same(again.value(), m), "COMMITTED survives a render");
}

bool ValidUtf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    std::uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (std::size_t k = 1; k < n; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 2) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr std::uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = ckpt::ParseCommitted(text);
  if (m.ok()) {
    FUZZ_CHECK(m->world_size >= 1 && m->world_size <= ckpt::kMaxWorldSize, "world size");
    CheckRoundTrip(m.value());
  }
  if (size >= 24) {
    ckpt::CommittedMarker f;
    std::memcpy(&f.version, data, 8);
    std::memcpy(&f.world_size, data + 8, 4);
    std::memcpy(&f.committed_at, data + 12, 8);
    f.job.assign(text.substr(24));
    // JSON carries text: a job of invalid UTF-8 cannot be written (job ids are ASCII).
    // World sizes over kMaxWorldSize are refused (no table per rank of a crafted 2^32).
    if (f.world_size >= 1 && f.world_size <= ckpt::kMaxWorldSize && ValidUtf8(f.job)) CheckRoundTrip(f);
  }
  return 0;
}
