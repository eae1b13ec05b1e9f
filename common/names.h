// Validation of the names a client sends: job ids and item names.
//
// Job ids become directory names under the checkpoint root and item names become keys in
// shard headers, so both are checked before anything is built from them. Each function
// returns an empty string when the name is acceptable, else a sentence saying what is wrong.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ckpt {

inline constexpr std::size_t kMaxJobIdLength = 128;
inline constexpr std::size_t kMaxItemNameLength = 255;

// Job id: 1-128 characters of [A-Za-z0-9._-], not starting with '.'.
std::string CheckJobId(std::string_view job);

// Item name: 1-255 printable ASCII characters, no '/', no "..", no control characters,
// not "__metadata__" (the safetensors metadata key).
std::string CheckItemName(std::string_view name);

// Renders a name for an error message: quoted, with unprintable bytes as \xNN, cut at 80.
std::string QuoteName(std::string_view name);

}  // namespace ckpt
