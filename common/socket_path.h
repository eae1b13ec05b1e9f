// The one rule for finding the daemon's socket, shared by the daemon, the C++ client,
// ckptctl and (through the binding) Python: $CKPTD_SOCKET if set and not empty, else
// /run/ckptd/ckptd.sock, the node daemon's (the systemd unit's RuntimeDirectory=ckptd).
#pragma once

#include <string>

namespace ckpt {

inline constexpr const char kSystemSocketPath[] = "/run/ckptd/ckptd.sock";

std::string DefaultClientSocketPath();

}  // namespace ckpt
