// Checksum: streaming xxh3-64 of one item's bytes, fed in pieces as they pass through.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ckpt {

class Checksum {
 public:
  Checksum();
  void Update(const void* data, std::size_t len);
  std::uint64_t Digest() const;

  // One-shot hash of a buffer.
  static std::uint64_t Of(const void* data, std::size_t len);

 private:
  struct Free {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
  };
  std::unique_ptr<XXH3_state_t, Free> state_;
};

// 16 lowercase hex digits, the form stored in shard headers.
std::string ChecksumHex(std::uint64_t value);
// Parses 16 hex digits; false if malformed.
bool ParseChecksumHex(const std::string& text, std::uint64_t* value);

}  // namespace ckpt
