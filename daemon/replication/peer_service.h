// PeerServer: the receiving side of replication, the Peer service (proto/ckpt/v1/peer.proto)
// on TCP (--peer-listen).
//
// In: calls from other daemons, each checked first against the shared secret (PeerSecret: a
// token bound to the call, its subject and this daemon); a refused call is counted
// (ckptd_replication_events_total{event="refused"}) and logged at most once a second.
// PutShard receives a replica, verified (every piece's checksum, the header, the image's
// MAC), into the memory tier under its budget (MemoryTier::ReserveReplica: replicas give way
// before own shards). GetShard serves an image, own or replica, to a restore on another
// daemon (shard_stream.h says what it checks). HasShard says whether one is held; DropNewer
// and DropJob drop images; ListReplicas lists the replicas of a job one origin sent (what a
// warm start of that node pulls back, warm_start.h). With --erasure (`parity` set), PutChunk
// folds a member's chunk into the parity held here (parity_store.h), GetParity serves it,
// GetChunk serves a byte range of an image held here to a rebuild, DropParity drops parity. Out: each answer carries this daemon's proof of the secret bound
// to the call's nonce, so that the caller knows a ckptd of its cluster answered.
//
// Connections come through a PeerAcceptor (within its limits), and gRPC runs each call on a
// thread of its own, at most 64 at once. Thread-safe: the handlers run concurrently; the
// owner starts and destroys the server.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "daemon/replication/peer_acceptor.h"
#include "daemon/base/peer_secret.h"
#include "daemon/tiers/memory_tier.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace ckpt {

class PeerServiceImpl;
class ParityStore;

class PeerServer {
 public:
  // Serves the Peer service on `listen` ("ADDR:PORT"; port 0 picks one), with `limits` on
  // the connections. `memory`, `parity` (null without --erasure) and `secret` must outlive the server; `self_address` is this
  // daemon's address in --peers, which the callers' tokens must name. InvalidArgument for a
  // bad address, IoError if it cannot listen there.
  static Result<std::unique_ptr<PeerServer>> Start(const std::string& listen, PeerAcceptor::Limits limits,
                                                   MemoryTier& memory, ParityStore* parity,
                                                   const PeerSecret& secret, std::string self_address);
  // Stops accepting connections, then shuts the server down (calls in flight get 200 ms).
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  // The address the server is bound to ("127.0.0.1:7001").
  const std::string& bound() const { return bound_; }

 private:
  PeerServer() = default;

  std::unique_ptr<PeerServiceImpl> service_;  // outlives server_, which calls it
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<PeerAcceptor> acceptor_;  // --peer-listen's connections, within limits
  std::string bound_;
};

}  // namespace ckpt
