#include "format/box.h"

#include <algorithm>
#include <cstring>

namespace ckpt {

std::uint64_t Box::elements() const {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0));
  return n;
}

bool Box::Contains(const Box& inner) const {
  if (inner.rank() != rank() || inner.offsets.size() != offsets.size()) return false;
  for (std::size_t d = 0; d < rank(); ++d) {
    if (inner.offsets[d] < offsets[d] || inner.offsets[d] + inner.shape[d] > offsets[d] + shape[d])
      return false;
  }
  return true;
}

std::string BoxText(const Box& box) {
  std::string s = "[";
  for (std::size_t d = 0; d < box.rank(); ++d) {
    s += (d ? ", " : "") + std::to_string(box.offsets[d]) + ":" +
         std::to_string(box.offsets[d] + box.shape[d]);
  }
  return s + "]";
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank() || a.offsets.size() != a.rank() || b.offsets.size() != b.rank())
    return std::nullopt;
  Box out;
  out.offsets.resize(a.rank());
  out.shape.resize(a.rank());
  for (std::size_t d = 0; d < a.rank(); ++d) {
    const std::int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const std::int64_t hi = std::min(a.offsets[d] + a.shape[d], b.offsets[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.shape[d] = hi - lo;
  }
  return out;
}

namespace {

// Row-major strides in elements of a buffer holding `box`.
std::vector<std::uint64_t> Strides(const Box& box) {
  std::vector<std::uint64_t> s(box.rank(), 1);
  for (std::size_t d = box.rank(); d-- > 1;) s[d - 1] = s[d] * static_cast<std::uint64_t>(box.shape[d]);
  return s;
}

// Element index, in a buffer holding `box`, of the element at global index `at`.
std::uint64_t IndexIn(const Box& box, const std::vector<std::uint64_t>& strides,
                      const std::vector<std::int64_t>& at) {
  std::uint64_t i = 0;
  for (std::size_t d = 0; d < box.rank(); ++d)
    i += static_cast<std::uint64_t>(at[d] - box.offsets[d]) * strides[d];
  return i;
}

// Calls run(src_index, dst_index, elements) for each contiguous run of `sub`, in row-major
// order. `dst_box` may equal `src_box` (TouchedRanges).
template <typename Run>
void ForEachRun(const Box& sub, const Box& src_box, const Box& dst_box, Run&& run) {
  if (sub.empty()) return;
  const std::size_t n = sub.rank();
  if (n == 0) {
    run(0, 0, 1);
    return;
  }
  // Dimensions k..n-1 form one run when sub spans dimensions k+1..n-1 of both boxes fully.
  std::size_t k = n - 1;
  while (k > 0 && sub.shape[k] == src_box.shape[k] && sub.shape[k] == dst_box.shape[k]) --k;
  std::uint64_t run_len = 1;
  for (std::size_t d = k; d < n; ++d) run_len *= static_cast<std::uint64_t>(sub.shape[d]);
  const auto ss = Strides(src_box), ds = Strides(dst_box);
  std::vector<std::int64_t> at = sub.offsets;  // dimensions k.. stay at sub's start
  while (true) {
    run(IndexIn(src_box, ss, at), IndexIn(dst_box, ds, at), run_len);
    // Next index over dimensions 0..k-1, the last fastest.
    std::size_t d = k;
    while (d > 0) {
      --d;
      if (++at[d] < sub.offsets[d] + sub.shape[d]) break;
      at[d] = sub.offsets[d];
      if (d == 0) return;
    }
    if (k == 0) return;
  }
}

}  // namespace

void CopySubBox(const Box& sub, const Box& src_box, const char* src, std::uint64_t src_skip,
                const Box& dst_box, char* dst, std::size_t elem, std::uint64_t clip_lo,
                std::uint64_t clip_hi) {
  ForEachRun(sub, src_box, dst_box, [&](std::uint64_t s, std::uint64_t d, std::uint64_t n) {
    const std::uint64_t b = std::max(s * elem, clip_lo), e = std::min((s + n) * elem, clip_hi);
    if (b >= e) return;
    std::memcpy(dst + d * elem + (b - s * elem), src + (b - src_skip), e - b);
  });
}

std::vector<BoxRun> SubBoxRuns(const Box& sub, const Box& src_box, const Box& dst_box, std::size_t elem) {
  std::vector<BoxRun> out;
  ForEachRun(sub, src_box, dst_box, [&](std::uint64_t s, std::uint64_t d, std::uint64_t n) {
    out.push_back({s * elem, d * elem, n * elem});
  });
  return out;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> TouchedRanges(const Box& box, const Box& sub,
                                                                   std::size_t elem) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  ForEachRun(sub, box, box, [&](std::uint64_t s, std::uint64_t, std::uint64_t n) {
    const std::uint64_t b = s * elem, e = (s + n) * elem;
    if (!out.empty() && out.back().second == b) {
      out.back().second = e;
    } else {
      out.emplace_back(b, e);
    }
  });
  return out;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> TouchedBlocks(
    const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges, std::uint64_t block,
    std::uint64_t total) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const auto& [b, e] : ranges) {
    if (e <= b) continue;
    const std::uint64_t first = b / block, last = (std::min(e, total) + block - 1) / block;
    if (!out.empty() && out.back().second >= first) {
      out.back().second = std::max(out.back().second, last);
    } else {
      out.emplace_back(first, last);
    }
  }
  return out;
}

}  // namespace ckpt
