// The default socket path, shared by the daemon, the client library and ckptctl:
// $CKPTD_SOCKET if set, else $XDG_RUNTIME_DIR/ckptd.sock, else /tmp/ckptd-$UID/ckptd.sock.
#pragma once

#include <string>

namespace ckpt {

std::string DefaultClientSocketPath();

}  // namespace ckpt
