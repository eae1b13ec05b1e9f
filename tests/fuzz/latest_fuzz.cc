// Fuzz target: the parser of ROOT/JOB/latest (format/markers.h, ParseLatest).
//
// Invariants: what parses renders back to the same text (up to the optional newline), and it
// agrees with std::from_chars on every text of plain decimal digits.
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

#include "format/markers.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto v = ckpt::ParseLatest(text);
  if (v) {
    std::string rendered = ckpt::RenderLatest(*v);
    FUZZ_CHECK(rendered == text || rendered == std::string(text) + "\n", "latest renders back as read");
    FUZZ_CHECK(ckpt::ParseLatest(rendered) == v, "a rendered latest parses");
  }
  std::string_view digits = text;
  if (!digits.empty() && digits.back() == '\n') digits.remove_suffix(1);
  bool canonical = !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos &&
                   (digits.size() == 1 || digits[0] != '0');
  if (canonical) {
    std::uint64_t want = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), want);
    bool fits = ec == std::errc() && end == digits.data() + digits.size();
    FUZZ_CHECK(v.has_value() == fits, "latest parses exactly the decimals that fit 64 bits");
    FUZZ_CHECK(!fits || *v == want, "latest's value");
  } else {
    FUZZ_CHECK(!v, "latest accepts only canonical decimals");
  }
  return 0;
}
