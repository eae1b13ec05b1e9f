#include "format/job_owner.h"

#include <cstdint>
#include <limits>

namespace ckpt {
namespace {

// A decimal id without sign, leading zeros or overflow; uid_t/gid_t -1 is "no id", so it
// is refused too.
std::optional<std::uint32_t> ParseId(std::string_view s) {
  if (s.empty() || s.size() > 10 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (v >= std::numeric_limits<std::uint32_t>::max()) return std::nullopt;
  return static_cast<std::uint32_t>(v);
}

// Takes "KEY=VALUE\n" off the front of `text`.
std::optional<std::uint32_t> TakeLine(std::string_view& text, std::string_view key) {
  if (text.size() <= key.size() + 1 || text.substr(0, key.size()) != key || text[key.size()] != '=') {
    return std::nullopt;
  }
  std::size_t end = text.find('\n');
  if (end == std::string_view::npos) return std::nullopt;
  auto id = ParseId(text.substr(key.size() + 1, end - key.size() - 1));
  if (id) text.remove_prefix(end + 1);
  return id;
}

}  // namespace

std::string FormatJobOwner(const JobOwner& owner) {
  std::string out = "uid=" + std::to_string(owner.uid) + "\n";
  if (owner.group) out += "group=" + std::to_string(*owner.group) + "\n";
  return out;
}

std::optional<JobOwner> ParseJobOwner(std::string_view text) {
  if (text.size() > kMaxOwnerFileBytes) return std::nullopt;
  JobOwner owner;
  auto uid = TakeLine(text, "uid");
  if (!uid) return std::nullopt;
  owner.uid = *uid;
  if (!text.empty()) {
    auto group = TakeLine(text, "group");
    if (!group) return std::nullopt;
    owner.group = *group;
  }
  if (!text.empty()) return std::nullopt;
  return owner;
}

std::string DescribeJobOwner(const JobOwner& owner) {
  std::string out = "uid " + std::to_string(owner.uid);
  if (owner.group) out += " (shared with group " + std::to_string(*owner.group) + ")";
  return out;
}

}  // namespace ckpt
