// Fuzz target: the parser of done markers and rank files (VERSION/rank-R.done and
// ranks/rank-R, format/markers.h ParseRegistration): both hold one registration id.
//
// Invariants: what parses is the text itself, of the documented length and characters, so two
// files match exactly when their bytes do (the commit rule compares them).
#include <cstdint>
#include <string_view>

#include "format/markers.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto id = ckpt::ParseRegistration(text);
  if (!id) return 0;
  FUZZ_CHECK(*id == text, "a registration id is the file's bytes");
  FUZZ_CHECK(!id->empty() && id->size() <= ckpt::kMaxRegistrationBytes, "registration id length");
  FUZZ_CHECK(id->find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ._-") ==
                 std::string_view::npos,
             "registration id characters");
  return 0;
}
