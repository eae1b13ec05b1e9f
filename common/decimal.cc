#include "common/decimal.h"

namespace ckpt {

std::optional<std::uint64_t> ParseDecimal(std::string_view s, std::uint64_t max) {
  if (max > kMaxDecimal) max = kMaxDecimal;
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (digit > max || v > (max - digit) / 10) return std::nullopt;  // v * 10 + digit > max
    v = v * 10 + digit;
  }
  return v;
}

std::optional<std::uint64_t> ParsePaddedDecimal(std::string_view s, std::uint64_t max) {
  std::size_t zeros = 0;
  while (zeros + 1 < s.size() && s[zeros] == '0') ++zeros;
  return ParseDecimal(s.substr(zeros), max);
}

}  // namespace ckpt
