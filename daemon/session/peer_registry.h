// PeerRegistry: who is on the other end of each accepted connection, and how many
// connections each uid holds.
//
// The daemon accepts Unix-socket connections itself (rpc/acceptor.h), reads SO_PEERCRED and
// SO_PEERGROUPS, records them here under the descriptor, and hands the descriptor to gRPC,
// which names the peer "fd:N". Each call looks its caller up by that name.
//
// gRPC tells nobody when it closes a connection, so an entry is known to be gone when its
// descriptor number no longer refers to the socket that was accepted (fstat: another inode,
// or closed). Entries are swept only when a limit would refuse a connection, so the cost of
// a sweep (one fstat per connection) is paid near the limits only. Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"

namespace ckpt {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups at connect time
};

class PeerRegistry {
 public:
  // Connections held at once: in all (`total`) and by one uid (`per_uid`); 0: no limit.
  struct Limits {
    std::uint32_t total = 0;
    std::uint32_t per_uid = 0;
  };

  explicit PeerRegistry(Limits limits) : limits_(limits) {}

  // Records the connection `fd` just accepted, unless that would pass a limit: then
  // ResourceExhausted naming the limit and the uid, and the caller closes `fd`.
  Status Add(int fd, PeerCredentials creds) EXCLUDES(mu_);
  // `peer` is grpc::ServerContext::peer(), e.g. "fd:7".
  std::optional<PeerCredentials> Lookup(const std::string& peer) const EXCLUDES(mu_);

 private:
  struct Entry {
    PeerCredentials creds;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  void Forget(std::map<int, Entry>::iterator it) REQUIRES(mu_);
  void SweepClosed() REQUIRES(mu_);
  // Which limit `uid` would pass with one more connection, or an empty string.
  std::string LimitPassed(uid_t uid) const REQUIRES(mu_);

  const Limits limits_;
  mutable Mutex mu_;
  std::map<int, Entry> by_fd_ GUARDED_BY(mu_);
  std::map<uid_t, std::uint32_t> per_uid_ GUARDED_BY(mu_);
};

}  // namespace ckpt
