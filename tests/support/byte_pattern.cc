#include "support/byte_pattern.h"

namespace ckpt::test {

std::string Bytes(std::uint64_t n, std::uint32_t seed) {
  std::string out(n, '\0');
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& c : out) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return out;
}

}  // namespace ckpt::test
