#include "daemon/rpc/peer_auth.h"

#include <unistd.h>

#include <algorithm>

namespace ckpt {

Result<PeerCredentials> PeerAuth::Check(const std::string& peer) const {
  if (registry_ == nullptr) return PeerCredentials{::getpid(), ::geteuid(), ::getegid(), {}};
  auto creds = registry_->Lookup(peer);
  if (!creds) return PermissionDenied("cannot identify the peer " + peer);
  const uid_t self = ::geteuid();
  if (creds->uid != self && std::find(allowed_.begin(), allowed_.end(), creds->uid) == allowed_.end()) {
    return PermissionDenied("peer uid " + std::to_string(creds->uid) + " (pid " + std::to_string(creds->pid) +
                            ") is not allowed: this daemon serves uid " + std::to_string(self) +
                            " (add --allow-uid " + std::to_string(creds->uid) + " to serve it)");
  }
  return *creds;
}

}  // namespace ckpt
