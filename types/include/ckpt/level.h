// How far a version has come: the one numbering of levels, used by the client library, the
// daemon and the Python module alike. The values are ordered (each level implies the ones
// below it), so "at least level L" is a comparison. The wire (ckpt.v1.Level, whose numbers
// are fixed by the protocol) is translated in one place, proto/level_codec.h.
#pragma once

#include <cstdint>

namespace ckpt {

enum class Level : std::uint8_t {
  // Not a level a version can be waited for: the daemon's state of a shard whose bytes are
  // still being copied out of trainer memory.
  kNone = 0,
  // Every byte is out of trainer memory: the trainer may mutate its state again.
  kCaptured = 1,
  // Durable on the daemon's node-local tier (without one, reached with kPersisted).
  kLocal = 2,
  // Durable on the persistent tier, and the rank's done marker written. kDurable is the
  // older name.
  kPersisted = 3,
  kDurable = 3,
  // Every rank persisted and COMMITTED written.
  kCommitted = 4,
  // The rank's shard is held, verified, in the memory of --replicas R peer
  // daemons. Not on the scale above (a shard may be replicated before or after it is
  // local or persisted): only a wait asks for it, and a daemon never reports it as the
  // level a version reached. With --replicas 0 a wait for it is FAILED_PRECONDITION.
  kReplicated = 5,
};

// "captured", "local", "persisted", "committed", "replicated" ("copying" for kNone).
const char* LevelName(Level level);

}  // namespace ckpt
