// Fuzz target: the parser of a job's owner file (ROOT/JOB/owner, format/job_owner.h
// ParseJobOwner), which decides who may use a job.
//
// Invariants: what parses is bounded, and renders back to the same bytes, so two daemons
// reading one owner file cannot see two owners (a lenient parse that ignored a byte could
// let "uid=10\0" and "uid=10" both stand for uid 10 while differing on disk).
#include <cstdint>
#include <string_view>

#include "format/job_owner.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto owner = ckpt::ParseJobOwner(text);
  if (!owner) return 0;
  FUZZ_CHECK(size <= ckpt::kMaxOwnerFileBytes, "owner file length");
  FUZZ_CHECK(ckpt::FormatJobOwner(*owner) == text, "an owner file renders back to its bytes");
  FUZZ_CHECK(ckpt::ParseJobOwner(ckpt::FormatJobOwner(*owner)) == owner, "round trip");
  return 0;
}
