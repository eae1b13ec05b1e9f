// Element types of tensor items, with their safetensors names and sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "ckpt/dtype.h"

namespace ckpt {

// Bytes per element (1 for the 8-bit floats and bool).
std::size_t DTypeSize(DType t);
// The safetensors spelling: "F32", "BF16", "F8_E4M3", "BOOL", ...
std::string_view DTypeName(DType t);
// Parses a safetensors dtype name; nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);
// True for a value of the enum (used to validate bytes read from shared memory).
bool IsValidDType(std::uint8_t raw);

}  // namespace ckpt
