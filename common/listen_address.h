// ListenAddress: a TCP address to listen on, written ADDR:PORT, where ADDR is an IPv4
// literal (127.0.0.1, 0.0.0.0), a bracketed IPv6 literal ([::1], [::]) or `localhost`
// (127.0.0.1), and PORT is 0 to 65535 (0: a free port the kernel picks). No name lookup:
// a daemon's listen address must not depend on a resolver at start.
#pragma once

#include <sys/socket.h>

#include <string>

#include "common/status.h"

namespace ckpt {

struct ListenAddress {
  sockaddr_storage addr{};
  socklen_t len = 0;
};

// InvalidArgument, naming the text and what is wrong with it, if malformed.
Result<ListenAddress> ParseListenAddress(const std::string& text);

// "127.0.0.1:9464", "[::1]:9464": the address as bound (with the port the kernel picked).
std::string FormatListenAddress(const sockaddr_storage& addr);

}  // namespace ckpt
