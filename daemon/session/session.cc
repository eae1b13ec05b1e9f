#include "daemon/session/session.h"

#include <poll.h>
#include <signal.h>

#include <cerrno>

namespace ckpt {

bool Session::TrainerExited() const {
  if (!pidfd.valid()) return peer.pid <= 0 || (::kill(peer.pid, 0) != 0 && errno == ESRCH);
  pollfd p{pidfd.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

}  // namespace ckpt
