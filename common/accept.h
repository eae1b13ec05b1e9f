// Accepting connections on a non-blocking listener: one accept4, its errors sorted the way
// every accept loop of the daemon (the trainers' Unix socket, the peer port, the metrics
// endpoint) acts on them, and the spare descriptor that lets a loop out of descriptors
// refuse a connection instead of spinning on it.
#pragma once

#include "common/unique_fd.h"

namespace ckpt {

enum class AcceptOutcome {
  kAccepted,           // `fd` is the connection (close-on-exec, non-blocking)
  kDrained,            // nothing more pending (EAGAIN)
  kTransient,          // that connection went away before it was taken: accept again
  kOutOfDescriptors,   // EMFILE/ENFILE: the connection stays pending (DescriptorReserve)
  kOutOfMemory,        // ENOBUFS/ENOMEM: the kernel is short of memory
  kFailed,             // anything else (`error` says what)
};

struct Accepted {
  AcceptOutcome outcome = AcceptOutcome::kFailed;
  UniqueFd fd;
  int error = 0;  // errno, for every outcome but kAccepted
};

// One accept4(SOCK_CLOEXEC | SOCK_NONBLOCK) on `listener`.
Accepted AcceptOne(int listener);

// A descriptor held in reserve. A listener out of descriptors sees its pending connection
// reported by poll again at once, forever; Shed frees the reserve, takes that connection
// and closes it (its client hears it was refused), then takes the reserve back. Not
// thread-safe: one per accept loop.
class DescriptorReserve {
 public:
  DescriptorReserve();
  // Sheds one pending connection of `listener`. True if one was shed and the reserve is
  // held again; false means the loop should back off.
  bool Shed(int listener);
  // Takes the reserve again if a Shed could not; true if it is held.
  bool Refill();

 private:
  UniqueFd fd_;
};

}  // namespace ckpt
