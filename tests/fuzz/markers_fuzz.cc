// Fuzz target: the parsers of the node markers (VERSION/node-OWNER.K.done and, issue 17,
// node-OWNER.K.repl: format/markers.h ParseNodeMarker) and of VERSION/RESTORABLE
// (ParseRestorable). They are read from a directory every node shares and anyone with write
// access may have edited.
//
// Invariants: what parses renders back to the same bytes (one spelling: two daemons reading
// one file see the same claims); a RESTORABLE names each rank 0..world_size-1 exactly once.
#include <cstdint>
#include <string>
#include <string_view>

#include "format/markers.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto claims = ckpt::ParseNodeMarker(text)) {
    FUZZ_CHECK(!claims->empty() && claims->size() <= ckpt::kMaxNodeMarkerRanks, "node marker rank count");
    FUZZ_CHECK(ckpt::RenderNodeMarker(*claims) == text, "a node marker renders back to its bytes");
  }
  if (auto marker = ckpt::ParseRestorable(text)) {
    FUZZ_CHECK(marker->world_size >= 1, "RESTORABLE world size");
    FUZZ_CHECK(marker->registrations.size() == marker->world_size, "RESTORABLE names every rank once");
    std::uint32_t expect = 0;
    for (const auto& [rank, registration] : marker->registrations) {
      FUZZ_CHECK(rank == expect++, "RESTORABLE ranks are 0..world_size-1");
      FUZZ_CHECK(ckpt::ParseRegistration(registration).has_value(), "RESTORABLE registration ids are valid");
    }
    FUZZ_CHECK(ckpt::RenderRestorable(*marker) == text, "a RESTORABLE renders back to its bytes");
  }
  return 0;
}
