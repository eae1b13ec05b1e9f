// Rounding sizes and offsets up to an alignment (O_DIRECT blocks, safetensors data offsets,
// chunk boundaries).
#pragma once

#include <cstdint>

namespace ckpt {

// The smallest multiple of `a` that is >= v. `a` > 0; v + a - 1 must not overflow.
constexpr std::uint64_t AlignUp(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace ckpt
