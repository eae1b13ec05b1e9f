// format/box: intersection, sub-box copies and touched byte ranges of N-d boxes, against a
// naive element-by-element reference over random boxes in 0 to 4 dimensions.
#include "format/box.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

using namespace ckpt;

namespace {

// A random box within `global`; may be empty when `allow_empty`.
Box RandomBox(std::mt19937& rng, const std::vector<std::int64_t>& global, bool allow_empty) {
  Box b;
  for (std::int64_t g : global) {
    const std::int64_t lo = std::uniform_int_distribution<std::int64_t>(0, g - 1)(rng);
    const std::int64_t len = std::uniform_int_distribution<std::int64_t>(allow_empty ? 0 : 1, g - lo)(rng);
    b.offsets.push_back(lo);
    b.shape.push_back(len);
  }
  return b;
}

// Calls f(global index) for every element of `box`, row-major.
template <typename F>
void ForEachElement(const Box& box, F&& f) {
  if (box.empty()) return;
  std::vector<std::int64_t> at = box.offsets;
  while (true) {
    f(at);
    std::size_t d = box.rank();
    while (true) {
      if (d == 0) return;
      --d;
      if (++at[d] < box.offsets[d] + box.shape[d]) break;
      at[d] = box.offsets[d];
    }
  }
}

std::uint64_t NaiveIndex(const Box& box, const std::vector<std::int64_t>& at) {
  std::uint64_t i = 0;
  for (std::size_t d = 0; d < box.rank(); ++d) {
    i = i * static_cast<std::uint64_t>(box.shape[d]) + static_cast<std::uint64_t>(at[d] - box.offsets[d]);
  }
  return i;
}

bool NaiveInside(const Box& box, const std::vector<std::int64_t>& at) {
  for (std::size_t d = 0; d < box.rank(); ++d) {
    if (at[d] < box.offsets[d] || at[d] >= box.offsets[d] + box.shape[d]) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("Box: Intersect agrees with element membership in 1 to 4 dimensions") {
  std::mt19937 rng(1);
  for (int iter = 0; iter < 3000; ++iter) {
    const std::size_t n = 1 + iter % 4;
    std::vector<std::int64_t> global;
    for (std::size_t d = 0; d < n; ++d) global.push_back(std::uniform_int_distribution<int>(1, 6)(rng));
    const Box a = RandomBox(rng, global, true), b = RandomBox(rng, global, true);
    const auto got = Intersect(a, b);
    Box all{std::vector<std::int64_t>(n, 0), global};
    std::uint64_t both = 0;
    ForEachElement(all, [&](const std::vector<std::int64_t>& at) {
      const bool in = NaiveInside(a, at) && NaiveInside(b, at);
      both += in;
      if (got) REQUIRE(NaiveInside(*got, at) == in);
    });
    REQUIRE(got.has_value() == (both > 0));
    if (got) {
      REQUIRE(got->elements() == both);
      REQUIRE(a.Contains(*got));
      REQUIRE(b.Contains(*got));
    }
  }
  REQUIRE_FALSE(Intersect(Box{{0}, {4}}, Box{{0, 0}, {4, 4}}).has_value());  // ranks differ
  REQUIRE_FALSE(Intersect(Box{{0}, {4}}, Box{{4}, {4}}).has_value());        // adjacent
}

TEST_CASE("Box: CopySubBox and TouchedRanges match a naive element copy in 0 to 4 dimensions") {
  std::mt19937 rng(2);
  const std::size_t elem_sizes[] = {1, 2, 4, 8};
  for (int iter = 0; iter < 4000; ++iter) {
    const std::size_t n = iter % 5;
    const std::size_t elem = elem_sizes[iter % 4];
    std::vector<std::int64_t> global;
    for (std::size_t d = 0; d < n; ++d) global.push_back(std::uniform_int_distribution<int>(1, 7)(rng));
    // Whole-extent boxes are common in real layouts (row and column splits): favour them.
    auto pick = [&] {
      Box b = RandomBox(rng, global, false);
      for (std::size_t d = 0; d < n; ++d) {
        if (rng() % 3 == 0) b.offsets[d] = 0, b.shape[d] = global[d];
      }
      return b;
    };
    const Box src_box = pick(), dst_box = pick();
    const auto sub = Intersect(src_box, dst_box);
    if (n > 0 && !sub) continue;
    const Box s = n == 0 ? Box{} : *sub;
    std::vector<char> src(src_box.elements() * elem);
    for (auto& c : src) c = static_cast<char>(rng());
    std::vector<char> want(dst_box.elements() * elem, '\x5a'), got = want;
    std::set<std::uint64_t> touched;
    ForEachElement(s, [&](const std::vector<std::int64_t>& at) {
      const std::uint64_t si = NaiveIndex(src_box, at), di = NaiveIndex(dst_box, at);
      for (std::size_t k = 0; k < elem; ++k) {
        want[di * elem + k] = src[si * elem + k];
        touched.insert(si * elem + k);
      }
    });
    if (n == 0) {  // a 0-d box is one element
      for (std::size_t k = 0; k < elem; ++k) want[k] = src[k], touched.insert(k);
    }
    CopySubBox(s, src_box, src.data(), 0, dst_box, got.data(), elem);
    REQUIRE(got == want);

    const auto ranges = TouchedRanges(src_box, s, elem);
    std::set<std::uint64_t> from_ranges;
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      REQUIRE(ranges[r].first < ranges[r].second);
      if (r > 0) REQUIRE(ranges[r - 1].second < ranges[r].first);  // merged and ascending
      for (std::uint64_t i = ranges[r].first; i < ranges[r].second; ++i) from_ranges.insert(i);
    }
    REQUIRE(from_ranges == touched);

    // Only the touched span given, from its first byte: the same result.
    const std::uint64_t lo = ranges.front().first, hi = ranges.back().second;
    std::vector<char> part(src.begin() + static_cast<std::ptrdiff_t>(lo),
                           src.begin() + static_cast<std::ptrdiff_t>(hi));
    std::vector<char> got2(want.size(), '\x5a');
    CopySubBox(s, src_box, part.data(), lo, dst_box, got2.data(), elem);
    REQUIRE(got2 == want);

    // Copied run by run (SubBoxRuns): the same result.
    std::vector<char> got4(want.size(), '\x5a');
    for (const BoxRun& run : SubBoxRuns(s, src_box, dst_box, elem)) {
      std::memcpy(got4.data() + run.dst, src.data() + run.src, run.bytes);
    }
    REQUIRE(got4 == want);

    // Copied in clipped pieces, each from its own buffer: the same result.
    std::vector<char> got3(want.size(), '\x5a');
    const std::uint64_t step = elem * (1 + rng() % 5);
    for (std::uint64_t a = 0; a < src.size(); a += step) {
      const std::uint64_t b = std::min<std::uint64_t>(a + step, src.size());
      std::vector<char> piece(src.begin() + static_cast<std::ptrdiff_t>(a),
                              src.begin() + static_cast<std::ptrdiff_t>(b));
      CopySubBox(s, src_box, piece.data(), a, dst_box, got3.data(), elem, a, b);
    }
    REQUIRE(got3 == want);

    // Blocks: every touched byte's block is in a run, and every block of a run is touched.
    const std::uint64_t block = 1 + rng() % 40;
    const auto blocks = TouchedBlocks(ranges, block, src.size());
    std::set<std::uint64_t> want_blocks, got_blocks;
    for (std::uint64_t i : touched) want_blocks.insert(i / block);
    for (std::size_t r = 0; r < blocks.size(); ++r) {
      if (r > 0) REQUIRE(blocks[r - 1].second < blocks[r].first);
      for (std::uint64_t b = blocks[r].first; b < blocks[r].second; ++b) got_blocks.insert(b);
    }
    REQUIRE(got_blocks == want_blocks);
  }
}

TEST_CASE("Box: a column split of a row-major matrix copies one run per row, a row split one run") {
  const Box global{{0, 0}, {4, 6}};
  const Box right{{0, 3}, {4, 3}};
  REQUIRE(TouchedRanges(global, right, 4).size() == 4);
  const Box rows{{1, 0}, {2, 6}};
  const auto r = TouchedRanges(global, rows, 4);
  REQUIRE(r.size() == 1);
  REQUIRE(r[0] == std::make_pair<std::uint64_t, std::uint64_t>(6 * 4, 18 * 4));
  REQUIRE(BoxText(right) == "[0:4, 3:6]");
}
