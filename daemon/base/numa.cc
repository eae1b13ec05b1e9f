#include "daemon/base/numa.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>

namespace ckpt {
namespace {

// Bits of a node mask; the kernel wants maxnode a little above the highest node.
constexpr unsigned long kMaxNodes = 1024;
using NodeMask = unsigned long[kMaxNodes / (8 * sizeof(unsigned long))];
constexpr unsigned long kMaskBits = 8 * sizeof(unsigned long);

std::string NodeList(const std::vector<int>& nodes) {
  std::string out;
  for (int n : nodes) out += (out.empty() ? "" : ",") + std::to_string(n);
  return out;
}

}  // namespace

Result<NumaPlacement> NumaPlacement::Parse(std::string_view text) {
  NumaPlacement p;
  if (text == "local") return p;
  if (text == "interleave") {
    p.mode = Mode::kInterleave;
    return p;
  }
  int node = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), node);
  if (ec != std::errc() || end != text.data() + text.size() || node < 0 ||
      node >= static_cast<int>(kMaxNodes)) {
    return InvalidArgument("--pool-numa " + std::string(text) +
                           ": give local, interleave or a NUMA node number");
  }
  p.mode = Mode::kNode;
  p.node = node;
  return p;
}

std::string NumaPlacement::Name() const {
  switch (mode) {
    case Mode::kLocal:
      return "local";
    case Mode::kInterleave:
      return "interleave";
    case Mode::kNode:
      return "node " + std::to_string(node);
  }
  return "?";
}

Result<std::vector<int>> AllowedNumaNodes() {
  NodeMask mask = {};
  if (::syscall(SYS_get_mempolicy, nullptr, mask, kMaxNodes, nullptr, MPOL_F_MEMS_ALLOWED) != 0) {
    return IoError("get_mempolicy (NUMA nodes allowed)", errno);
  }
  std::vector<int> nodes;
  for (unsigned long n = 0; n < kMaxNodes; ++n) {
    if (mask[n / kMaskBits] >> (n % kMaskBits) & 1) nodes.push_back(static_cast<int>(n));
  }
  return nodes;
}

Status ApplyNumaPlacement(void* base, std::size_t bytes, const NumaPlacement& placement) {
  if (placement.mode == NumaPlacement::Mode::kLocal) return Status::Ok();
  auto allowed = AllowedNumaNodes();
  if (!allowed.ok())
    return allowed.status().With("--pool-numa " + placement.Name() + ": this kernel has no NUMA support");
  NodeMask mask = {};
  int policy = MPOL_INTERLEAVE;
  if (placement.mode == NumaPlacement::Mode::kNode) {
    bool ok = false;
    for (int n : allowed.value()) ok = ok || n == placement.node;
    if (!ok) {
      return InvalidArgument(
          "--pool-numa " + std::to_string(placement.node) +
          ": not a NUMA node this daemon may allocate on (allowed: " + NodeList(allowed.value()) + ")");
    }
    policy = MPOL_BIND;
    mask[placement.node / kMaskBits] |= 1ul << (placement.node % kMaskBits);
  } else {
    for (int n : allowed.value()) mask[n / kMaskBits] |= 1ul << (n % kMaskBits);
  }
  if (::syscall(SYS_mbind, base, bytes, policy, mask, kMaxNodes, 0) != 0) {
    return IoError("mbind of the host pool (--pool-numa " + placement.Name() + ")", errno);
  }
  return Status::Ok();
}

std::map<int, std::uint64_t> SampleNumaNodes(const void* base, std::size_t bytes, std::size_t stride) {
  std::map<int, std::uint64_t> out;
  if (stride == 0) return out;
  std::vector<void*> pages;
  for (std::size_t off = 0; off < bytes; off += stride) {
    pages.push_back(const_cast<char*>(static_cast<const char*>(base)) + off);
  }
  std::vector<int> status(pages.size(), -1);
  // With no target nodes, move_pages only reports where each page is.
  if (::syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0) != 0) return out;
  for (int node : status) {
    if (node >= 0) ++out[node];
  }
  return out;
}

std::string DescribeNumaNodes(const std::map<int, std::uint64_t>& pages) {
  if (pages.empty()) return "unknown";
  if (pages.size() == 1) return "node " + std::to_string(pages.begin()->first);
  std::uint64_t total = 0;
  for (const auto& [node, n] : pages) total += n;
  std::string out = "nodes ";
  for (const auto& [node, n] : pages) {
    if (out.size() > 6) out += ", ";
    out += std::to_string(node) + " (" + std::to_string((n * 100 + total / 2) / total) + "%)";
  }
  return out;
}

}  // namespace ckpt
