// PeerAcceptor: the peer server's TCP listener (--peer-listen), accepted by the daemon
// itself rather than by gRPC, so that what anyone on the network can open is bounded.
//
// In: connections to the listener. It holds at most `total` at once, and `per_address` from
// one remote address; one over a limit is closed at once (refusals logged at most once a
// second). Out: the accepted descriptors, to `hand_over` (grpc::AddInsecureChannelFromFd),
// which owns them from then on. Without these limits, connections that never make a call
// hold a descriptor each until the daemon has none left, and then the Unix socket every
// user's trainers talk to fails too.
//
// gRPC tells nobody when it closes a connection, so each is known gone when its descriptor
// no longer refers to the socket accepted (fstat: another inode, or closed), swept only when
// a limit would refuse one (as rpc/PeerRegistry does for the Unix socket). Out of
// descriptors (EMFILE), it accepts with a reserve descriptor and closes at once, as
// rpc/Acceptor does, so it never spins. One thread of its own; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/accept.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "daemon/base/throttled_log.h"

namespace ckpt {

class PeerAcceptor {
 public:
  struct Limits {
    std::uint32_t total = 0;
    std::uint32_t per_address = 0;
  };
  // The limits --peer-max-connections and --peer-max-connections-per-address give; a total
  // of 0 there is a quarter of the open-file limit (the rest is for the Unix socket's
  // connections, regions and shard files), within 16 and 4096.
  static Limits LimitsOf(std::uint32_t max_connections, std::uint32_t max_per_address);
  // Binds `listen` ("ADDR:PORT", "[ADDR]:PORT"; port 0 picks one) and starts accepting.
  // IoError if it cannot listen there.
  static Result<std::unique_ptr<PeerAcceptor>> Start(const std::string& listen, Limits limits,
                                                     std::function<void(int fd)> hand_over);
  // Stops accepting and closes the listener (connections handed over stay gRPC's).
  ~PeerAcceptor();
  PeerAcceptor(const PeerAcceptor&) = delete;
  PeerAcceptor& operator=(const PeerAcceptor&) = delete;

  int port() const { return port_; }
  const Limits& limits() const { return limits_; }
  // Connections held now (after a sweep), for tests and status.
  std::size_t Held() EXCLUDES(mu_);

 private:
  struct Entry {
    std::string address;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  PeerAcceptor(UniqueFd listener, int port, Limits limits, std::function<void(int)> hand_over);
  void Loop();
  void AcceptPending();
  // Why one more connection from `address` would pass a limit, or "".
  std::string LimitPassed(const std::string& address) REQUIRES(mu_);
  void SweepClosed() REQUIRES(mu_);
  void Forget(std::map<int, Entry>::iterator it) REQUIRES(mu_);

  UniqueFd listener_, stop_read_, stop_write_;
  DescriptorReserve reserve_;  // sheds a connection when out of descriptors
  const int port_;
  const Limits limits_;
  const std::function<void(int)> hand_over_;
  ThrottledLog refused_log_;
  Mutex mu_;
  std::map<int, Entry> by_fd_ GUARDED_BY(mu_);
  std::map<std::string, std::uint32_t> per_address_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ckpt
