// Acceptor: takes connections off the daemon's listening socket and hands them to gRPC.
//
// In: the non-blocking listening socket. For each connection it reads who is on the other
// end (SO_PEERCRED, SO_PEERGROUPS) and records it in the PeerRegistry, which applies the
// connection limits (in all, per uid): a connection over a limit is closed at once, so one
// uid cannot hold every descriptor. Out: the accepted descriptors, to `hand_over`.
//
// It never spins. When the process is out of descriptors (EMFILE, ENFILE) the pending
// connection would stay in the backlog and poll() would report it again at once, forever:
// instead the acceptor closes a reserve descriptor it keeps, accepts the connection with
// it, closes the connection and takes the reserve back, so the client hears at once that
// it was refused. If even that fails, AcceptPending returns false and the caller waits
// kBackoff before polling the listener again. Refusals are logged at most once a second,
// with the number suppressed meanwhile. Not thread-safe: one accept loop owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "common/accept.h"
#include "common/unique_fd.h"
#include "daemon/session/peer_registry.h"
#include "daemon/base/throttled_log.h"

namespace ckpt {

class Acceptor {
 public:
  static constexpr std::chrono::milliseconds kBackoff{100};

  Acceptor(int listen_fd, PeerRegistry& peers, std::function<void(int fd)> hand_over);

  // Accepts the pending connections (at most a batch, so the caller's loop also sees its
  // other descriptors). Returns false when the caller should back off for kBackoff.
  bool AcceptPending();

 private:
  const int listen_fd_;
  PeerRegistry& peers_;
  const std::function<void(int)> hand_over_;
  DescriptorReserve reserve_;  // sheds a connection when out of descriptors
  ThrottledLog limit_log_;      // refused connections, at most one line a second
  ThrottledLog exhausted_log_;
};

}  // namespace ckpt
