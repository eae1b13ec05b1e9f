// The owner file of a job, ROOT/JOB/owner (format/paths.h): which uid a job belongs to.
//
// The daemon serving a job's first registration writes it once, on the persistent tier, so
// every daemon sharing that root (every node of the job) enforces the same owner. Text, one
// "key=value" per line:
//
//   uid=1000          the owner's uid (required, first)
//   group=2000        a group whose members share the job (optional: --job-group)
//
// Parsing is strict and bounded: anything else (another key, a repeated key, a number that
// does not fit, a missing newline) is not an owner file.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

namespace ckpt {

struct JobOwner {
  uid_t uid = 0;
  std::optional<gid_t> group;

  bool operator==(const JobOwner&) const = default;
};

// The largest owner file ParseJobOwner accepts, in bytes.
inline constexpr std::size_t kMaxOwnerFileBytes = 64;

std::string FormatJobOwner(const JobOwner& owner);
std::optional<JobOwner> ParseJobOwner(std::string_view text);

// "uid 1000" or "uid 1000 (group 2000)", for messages.
std::string DescribeJobOwner(const JobOwner& owner);

}  // namespace ckpt
