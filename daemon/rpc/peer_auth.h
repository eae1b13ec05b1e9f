// PeerAuth: who is calling, and may they. The caller's credentials come from SO_PEERCRED,
// recorded by the accept loop for each connection (PeerRegistry); the daemon serves its own
// uid and the uids of --allow-uid, and refuses everyone else with a message saying how to
// allow them. Thread-safe.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/session/peer_registry.h"

namespace ckpt {

class PeerAuth {
 public:
  // `registry` null: in-process use (tests of the service alone), the caller is this process.
  PeerAuth(const PeerRegistry* registry, std::vector<uid_t> allowed)
      : registry_(registry), allowed_(std::move(allowed)) {}

  // `peer` is grpc::ServerContext::peer().
  Result<PeerCredentials> Check(const std::string& peer) const;

 private:
  const PeerRegistry* registry_;
  const std::vector<uid_t> allowed_;
};

}  // namespace ckpt
