// PeerRegistry: who is on the other end of each accepted connection.
//
// The daemon accepts Unix-socket connections itself, reads SO_PEERCRED, records it here
// under the descriptor, and hands the descriptor to gRPC, which names the peer "fd:N".
// Each call looks its caller up by that name. Thread-safe.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>

#include "common/mutex.h"

namespace ckpt {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class PeerRegistry {
 public:
  void Add(int fd, PeerCredentials creds);
  // `peer` is grpc::ServerContext::peer(), e.g. "fd:7".
  std::optional<PeerCredentials> Lookup(const std::string& peer) const;

 private:
  mutable Mutex mu_;
  std::map<int, PeerCredentials> by_fd_ GUARDED_BY(mu_);
};

}  // namespace ckpt
