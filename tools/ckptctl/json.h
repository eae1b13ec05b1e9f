// Replies as JSON, the one way every --json output is made: each field under its proto name
// (fields at their default value included), integers of every width as JSON numbers (not
// the strings protobuf's own JSON printer makes of 64-bit ones), levels as their short words
// (common.h: LevelWord), shard states as their lower-case words (common.h: StateWord).
#pragma once

#include <google/protobuf/message.h>

#include <nlohmann/json.hpp>

namespace ckptctl {

nlohmann::ordered_json ToJson(const google::protobuf::Message& m);

}  // namespace ckptctl
