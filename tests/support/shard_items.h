// Shard items for tests of the format: a tensor of a dtype and shape (its length follows from
// them) and a blob of a size, with no data behind them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "format/dtype.h"
#include "format/shard_format.h"

namespace ckpt::test {

inline ShardItem TensorItem(std::string name, DType dtype, std::vector<std::int64_t> shape) {
  ShardItem item;
  item.name = std::move(name);
  item.kind = ItemKind::kTensor;
  item.dtype = dtype;
  item.shape = std::move(shape);
  std::uint64_t n = 1;
  for (auto d : item.shape) n *= static_cast<std::uint64_t>(d);
  item.length = n * DTypeSize(dtype);
  return item;
}

inline ShardItem BlobItem(std::string name, std::uint64_t bytes) {
  ShardItem item;
  item.name = std::move(name);
  item.kind = ItemKind::kBlob;
  item.dtype = DType::kU8;
  item.shape = {static_cast<std::int64_t>(bytes)};
  item.length = bytes;
  return item;
}

}  // namespace ckpt::test
