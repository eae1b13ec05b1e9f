// Decimal numbers in names and marker files: the one parser, with one rule.
//
// Checkpoint directories and markers spell numbers in decimal ("v0000000042", "rank-00003",
// "uid=1000"), and a name that parses must have one spelling only, or two files could name
// the same version. The rule: ASCII digits only, no sign, no leading zero ("0" alone aside),
// at most 19 digits (kMaxDecimal: every such number fits in 64 bits, so none wraps), and no
// value above the caller's `max`. Fixed-width names ("v%010llu") strip their padding with
// ParsePaddedDecimal, and their callers compare the re-rendered name with the original.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ckpt {

// The largest number a name or marker may spell: 19 nines.
inline constexpr std::uint64_t kMaxDecimal = 9'999'999'999'999'999'999ULL;

// The value of `s` under the rule above, or nullopt if `s` breaks it.
std::optional<std::uint64_t> ParseDecimal(std::string_view s, std::uint64_t max = kMaxDecimal);

// ParseDecimal after dropping leading zeros (at least one digit is kept): for names of fixed
// width, whose caller checks that rendering the value gives the same name back.
std::optional<std::uint64_t> ParsePaddedDecimal(std::string_view s, std::uint64_t max = kMaxDecimal);

}  // namespace ckpt
