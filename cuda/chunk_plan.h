// ChunkPlan: how the bytes of one shard are copied out of device memory, chunk by chunk.
//
// In: the shard's items in file order, packed from data offset 0 with no gaps (as
// ShardLayout plans them: only each item's length and offset are read), a chunk size and
// a number of copy streams K. Out: chunks in file order, each a run of at most
// chunk_bytes bytes of the data section (all full but the last), made of pieces
// (item, offset in item, offset in chunk, length). An item larger than a chunk, or one
// crossing a chunk boundary, is split into several pieces; empty items get no piece.
// Chunk i goes to copy stream i % K, so K chunks are in flight at once and consecutive
// chunks (which the flush engine writes in order) finish in about the order they start.
//
// A chunk is one pool chunk and one aligned O_DIRECT write: chunk_bytes must be a
// multiple of 4 KiB between 8 and 64 MiB.
//
// Pure logic, no CUDA. Thread-safety: a ChunkPlan is an immutable value once built.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "format/shard_format.h"

namespace ckpt::cuda {

inline constexpr std::uint64_t kMinCopyChunkBytes = 8ull << 20;
inline constexpr std::uint64_t kMaxCopyChunkBytes = 64ull << 20;
inline constexpr std::uint32_t kMaxCopyStreams = 16;

struct ChunkPlanOptions {
  std::uint64_t chunk_bytes = 16ull << 20;
  std::uint32_t streams = 2;
};

struct CopyPiece {
  std::uint32_t item = 0;          // index into the shard's items
  std::uint64_t item_offset = 0;   // first byte of the item in this piece
  std::uint64_t chunk_offset = 0;  // where it lands in the chunk
  std::uint64_t length = 0;
};

struct CopyChunk {
  std::uint64_t index = 0;        // chunks are numbered in file order
  std::uint64_t data_offset = 0;  // offset of the chunk in the data section
  std::uint64_t length = 0;       // chunk_bytes, or less for the last chunk
  std::uint32_t stream = 0;       // copy stream, index % streams
  std::vector<CopyPiece> pieces;  // in item order; lengths sum to `length`
};

struct ChunkPlan {
  std::uint64_t chunk_bytes = 0;
  std::uint32_t streams = 0;
  std::uint64_t data_bytes = 0;
  std::vector<CopyChunk> chunks;

  // Indices of the chunks of one stream, in the order that stream copies them.
  std::vector<std::uint64_t> ChunksOfStream(std::uint32_t stream) const;
};

// Checks chunk size and stream count.
Status CheckChunkPlanOptions(const ChunkPlanOptions& options);

// Plans the copy of `items`. Fails on bad options or items that are not packed in order.
Result<ChunkPlan> PlanChunks(const std::vector<ShardItem>& items, const ChunkPlanOptions& options);

}  // namespace ckpt::cuda
