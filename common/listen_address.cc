#include "common/listen_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdlib>

namespace ckpt {

Result<ListenAddress> ParseListenAddress(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("listen address '" + text + "' " + why +
                           " (expected ADDR:PORT, e.g. 127.0.0.1:9464 or [::1]:9464)");
  };
  std::string host, port;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) return bad("has no closing ']'");
    if (close + 1 >= text.size() || text[close + 1] != ':') return bad("has no ':PORT' after ']'");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return bad("has no ':PORT'");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) return bad("is an IPv6 address without brackets");
  }
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) {
    return bad("has no valid port");
  }
  const unsigned long p = std::strtoul(port.c_str(), nullptr, 10);
  if (p > 65535) return bad("has a port above 65535");
  if (host == "localhost") host = "127.0.0.1";
  ListenAddress out;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out.addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out.addr);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<std::uint16_t>(p));
    out.len = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<std::uint16_t>(p));
    out.len = sizeof(sockaddr_in6);
  } else {
    return bad("has no IPv4 or bracketed IPv6 literal (or 'localhost') before the port");
  }
  return out;
}

std::string FormatListenAddress(const sockaddr_storage& addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]:" + std::to_string(ntohs(v6->sin6_port));
  }
  const auto* v4 = reinterpret_cast<const sockaddr_in*>(&addr);
  ::inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(v4->sin_port));
}

}  // namespace ckpt
