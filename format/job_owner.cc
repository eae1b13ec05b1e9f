#include "format/job_owner.h"

#include <cstdint>
#include <limits>

#include "common/decimal.h"

namespace ckpt {
namespace {

// A uid or gid in decimal (common/decimal.h); uid_t/gid_t -1 is "no id", so it is refused.
std::optional<std::uint32_t> ParseId(std::string_view s) {
  auto v = ParseDecimal(s, std::numeric_limits<std::uint32_t>::max() - 1);
  if (!v) return std::nullopt;
  return static_cast<std::uint32_t>(*v);
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
