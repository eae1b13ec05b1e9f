#include "proto/level_codec.h"

namespace ckpt {

v1::Level LevelToProto(Level level) {
  switch (level) {
    case Level::kNone:
      return v1::LEVEL_UNSPECIFIED;
    case Level::kCaptured:
      return v1::LEVEL_CAPTURED;
    case Level::kLocal:
      return v1::LEVEL_LOCAL;
    case Level::kPersisted:
      return v1::LEVEL_PERSISTED;
    case Level::kCommitted:
      return v1::LEVEL_COMMITTED;
    case Level::kReplicated:
      return v1::LEVEL_REPLICATED;
  }
  return v1::LEVEL_UNSPECIFIED;
}

Level LevelFromProto(v1::Level level) {
  switch (level) {
    case v1::LEVEL_CAPTURED:
      return Level::kCaptured;
    case v1::LEVEL_LOCAL:
      return Level::kLocal;
    case v1::LEVEL_PERSISTED:
      return Level::kPersisted;
    case v1::LEVEL_COMMITTED:
      return Level::kCommitted;
    case v1::LEVEL_REPLICATED:
      return Level::kReplicated;
    default:
      return Level::kNone;
  }
}

}  // namespace ckpt
