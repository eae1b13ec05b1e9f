#include "cuda/chunk_plan.h"

#include <algorithm>
#include <string>

namespace ckpt::cuda {

std::vector<std::uint64_t> ChunkPlan::ChunksOfStream(std::uint32_t stream) const {
  std::vector<std::uint64_t> out;
  for (const CopyChunk& c : chunks) {
    if (c.stream == stream) out.push_back(c.index);
  }
  return out;
}

Status CheckChunkPlanOptions(const ChunkPlanOptions& options) {
  if (options.chunk_bytes < kMinCopyChunkBytes || options.chunk_bytes > kMaxCopyChunkBytes) {
    return InvalidArgument("copy chunk size " + std::to_string(options.chunk_bytes) +
                           " is outside 8 MiB to 64 MiB");
  }
  if (options.chunk_bytes % kDataAlignment != 0) {
    return InvalidArgument("copy chunk size " + std::to_string(options.chunk_bytes) +
                           " is not a multiple of " + std::to_string(kDataAlignment));
  }
  if (options.streams == 0 || options.streams > kMaxCopyStreams) {
    return InvalidArgument("copy stream count " + std::to_string(options.streams) + " is outside 1 to " +
                           std::to_string(kMaxCopyStreams));
  }
  return Status::Ok();
}

Result<ChunkPlan> PlanChunks(const std::vector<ShardItem>& items, const ChunkPlanOptions& options) {
  if (Status s = CheckChunkPlanOptions(options); !s.ok()) return s;
  ChunkPlan plan;
  plan.chunk_bytes = options.chunk_bytes;
  plan.streams = options.streams;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].offset != plan.data_bytes) {
      return InvalidArgument("item " + items[i].name + " starts at data offset " +
                             std::to_string(items[i].offset) + ", not at " + std::to_string(plan.data_bytes) +
                             " where the previous item ends");
    }
    if (items[i].length > UINT64_MAX - plan.data_bytes) return InvalidArgument("items overflow 64 bits");
    plan.data_bytes += items[i].length;
  }
  if (items.size() > UINT32_MAX) return InvalidArgument("too many items");

  const std::uint64_t chunk_count = (plan.data_bytes + options.chunk_bytes - 1) / options.chunk_bytes;
  plan.chunks.reserve(chunk_count);
  std::uint32_t item = 0;
  std::uint64_t in_item = 0;
  for (std::uint64_t c = 0; c < chunk_count; ++c) {
    CopyChunk chunk;
    chunk.index = c;
    chunk.data_offset = c * options.chunk_bytes;
    chunk.length = std::min(options.chunk_bytes, plan.data_bytes - chunk.data_offset);
    chunk.stream = static_cast<std::uint32_t>(c % options.streams);
    std::uint64_t filled = 0;
    while (filled < chunk.length) {
      // Skips empty and finished items; the sums above guarantee one with bytes left.
      while (in_item == items[item].length) {
        ++item;
        in_item = 0;
      }
      const std::uint64_t n = std::min(chunk.length - filled, items[item].length - in_item);
      chunk.pieces.push_back(CopyPiece{item, in_item, filled, n});
      filled += n;
      in_item += n;
    }
    plan.chunks.push_back(std::move(chunk));
  }
  return plan;
}

}  // namespace ckpt::cuda
