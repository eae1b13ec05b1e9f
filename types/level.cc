// The names of levels (ckpt/level.h). Part of libckpt's public API, hence CKPT_API: every
// library that includes the types layer links this object.
#include "ckpt/level.h"

#include "ckpt/export.h"

namespace ckpt {

CKPT_API const char* LevelName(Level level) {
  switch (level) {
    case Level::kNone:
      return "copying";
    case Level::kCaptured:
      return "captured";
    case Level::kLocal:
      return "local";
    case Level::kPersisted:
      return "persisted";
    case Level::kCommitted:
      return "committed";
    case Level::kReplicated:
      return "replicated";
  }
  return "copying";
}

}  // namespace ckpt
