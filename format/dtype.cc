#include "format/dtype.h"

#include <array>
#include <utility>

namespace ckpt {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 15> kTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU64, "U64", 8},
    {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

const DTypeInfo& Info(DType t) { return kTypes[static_cast<std::size_t>(t) - 1]; }

}  // namespace

bool IsValidDType(std::uint8_t raw) { return raw >= 1 && raw <= kTypes.size(); }
std::size_t DTypeSize(DType t) { return Info(t).size; }
std::string_view DTypeName(DType t) { return Info(t).name; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kTypes) {
    if (info.name == name) return info.type;
  }
  return std::nullopt;
}

}  // namespace ckpt
