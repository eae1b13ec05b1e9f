// Bytes: deterministic test data, different for every seed, so that what a test reads back
// (from a shard file, a region, a dump) can be compared with what it put in. The same
// (n, seed) always gives the same bytes, and a shorter run is a prefix of a longer one.
// A pure function: safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace ckpt::test {

// `n` bytes of the pattern of `seed`.
std::string Bytes(std::uint64_t n, std::uint32_t seed);

}  // namespace ckpt::test
