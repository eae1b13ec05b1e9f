// The one translation between ckpt::Level (ckpt/level.h, ordered) and the wire's
// ckpt.v1.Level (numbers fixed by the protocol, not ordered: LEVEL_LOCAL came later).
// Used by the daemon's RPC layer and by the client library; nothing else converts levels.
#pragma once

#include "ckpt/level.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

// kNone becomes LEVEL_UNSPECIFIED.
v1::Level LevelToProto(Level level);
// LEVEL_UNSPECIFIED and unknown numbers become kNone.
Level LevelFromProto(v1::Level level);

}  // namespace ckpt
