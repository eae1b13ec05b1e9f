#include "daemon/rpc/peer_registry.h"

#include <cstdlib>

namespace ckpt {

void PeerRegistry::Add(int fd, PeerCredentials creds) {
  MutexLock lock(mu_);
  by_fd_[fd] = creds;  // a reused descriptor number replaces the closed connection's entry
}

std::optional<PeerCredentials> PeerRegistry::Lookup(const std::string& peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (peer.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  char* end = nullptr;
  long fd = std::strtol(peer.c_str() + kPrefix.size(), &end, 10);
  if (end == peer.c_str() + kPrefix.size()) return std::nullopt;
  MutexLock lock(mu_);
  auto it = by_fd_.find(static_cast<int>(fd));
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

}  // namespace ckpt
