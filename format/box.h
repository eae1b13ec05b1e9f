// Box: an N-d box of a global tensor (a chunk a rank holds, or the part a rank asks for),
// as DCP's chunk metadata describes one: its first index in each dimension and its extent.
// A buffer "holds" a box when it has the box's elements in row-major order (the last
// dimension varies fastest), the layout of a contiguous tensor and of a safetensors item.
//
// What the elastic restore needs from boxes: where two boxes overlap (Intersect), copying
// the overlap from the buffer of one box into the buffer of another in as few contiguous
// runs as the shapes allow (CopySubBox), and which bytes of a buffer an overlap touches
// (TouchedRanges), to read and verify only those blocks of a chunk. Plain functions of their
// arguments; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ckpt {

struct Box {
  std::vector<std::int64_t> offsets;  // first index per dimension (>= 0)
  std::vector<std::int64_t> shape;    // extent per dimension (>= 0)

  std::size_t rank() const { return shape.size(); }
  // Elements in the box (1 for a 0-d box).
  std::uint64_t elements() const;
  bool empty() const { return elements() == 0; }
  // Whether `inner` lies within this box (same rank).
  bool Contains(const Box& inner) const;
  bool operator==(const Box& o) const { return offsets == o.offsets && shape == o.shape; }
};

// "[0:256, 128:512]": each dimension's half-open index range.
std::string BoxText(const Box& box);

// The overlap of two boxes of the same rank; nullopt when they do not overlap (or one is
// empty, or the ranks differ).
std::optional<Box> Intersect(const Box& a, const Box& b);

// Copies the elements of `sub` from `src`, which holds `src_box`, into `dst`, which holds
// `dst_box` (`sub` lies within both; all three of one rank). Elements are `elem` bytes.
// `src` may hold only part of its box's buffer: src[0] is byte `src_skip` of it. Only the
// bytes of `sub` at [clip_lo, clip_hi) of the source buffer are copied (they must be in
// `src`; see TouchedRanges), so a chunk read in pieces is copied piece by piece; clip
// bounds are multiples of `elem`. Trailing dimensions that `sub`, `src_box` and `dst_box`
// span alike are copied as one run.
void CopySubBox(const Box& sub, const Box& src_box, const char* src, std::uint64_t src_skip,
                const Box& dst_box, char* dst, std::size_t elem, std::uint64_t clip_lo = 0,
                std::uint64_t clip_hi = UINT64_MAX);

// One contiguous run of a sub-box: `bytes` bytes at byte `src` of a buffer holding the source
// box and at byte `dst` of one holding the destination box.
struct BoxRun {
  std::uint64_t src = 0, dst = 0, bytes = 0;
};
// The runs CopySubBox copies, in row-major order (for a copy through another interface than
// memcpy, e.g. writes into a region).
std::vector<BoxRun> SubBoxRuns(const Box& sub, const Box& src_box, const Box& dst_box, std::size_t elem);

// The byte ranges [begin, end) of a buffer holding `box` that the elements of `sub` (within
// `box`) occupy, ascending, adjacent ranges merged.
std::vector<std::pair<std::uint64_t, std::uint64_t>> TouchedRanges(const Box& box, const Box& sub,
                                                                   std::size_t elem);

// The indices of the `block`-byte blocks of a buffer of `total` bytes that `ranges` touch,
// grouped into runs of consecutive blocks: [first, last) block index pairs, ascending.
std::vector<std::pair<std::uint64_t, std::uint64_t>> TouchedBlocks(
    const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges, std::uint64_t block,
    std::uint64_t total);

}  // namespace ckpt
