// Element types of tensor items. The values are part of the descriptor-table layout.
#pragma once

#include <cstdint>

namespace ckpt {

enum class DType : std::uint8_t {
  kF64 = 1,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

}  // namespace ckpt
