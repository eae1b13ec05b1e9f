// FakePeer: something on a peer's address that is not that peer's ckptd: a Peer server (the
// generated stub) in the test process. Without a secret it is what an attacker on the node
// would build: it acknowledges every PutShard, says it holds the shards it was given
// (HasShard) and streams them (GetShard), shards built like the daemon's (RebuildShard: a
// valid header, item and header checksums recomputed), so only the key it does not have can
// tell them from a daemon's. With the secret it is a peer that knows it but misbehaves: it
// proves its answers and MACs its images as a daemon does, and serves what it was given (a
// copy that does not fit, say), or stalls a GetShard after the first piece. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "daemon/base/peer_secret.h"
#include "format/shard_format.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace ckpt::test {

class FakePeer {
 public:
  struct Options {
    // Set: proofs and MACs made with it. Null: none (an impostor).
    const PeerSecret* secret = nullptr;
    // GetShard sends the first piece (the whole header), then waits until the call is
    // cancelled or the fake stops.
    bool stall_after_first_piece = false;
  };
  // Listens on `address` ("127.0.0.1:PORT"); throws if it cannot.
  FakePeer(const std::string& address, Options options);
  ~FakePeer();
  FakePeer(const FakePeer&) = delete;
  FakePeer& operator=(const FakePeer&) = delete;

  // HasShard and GetShard of (job, version, rank) answer with `file` (a shard image),
  // written by `registration`.
  void Hold(const std::string& job, std::uint64_t version, std::uint32_t rank, std::string file,
            std::string registration);

  std::uint64_t puts_acknowledged() const { return puts_; }
  std::uint64_t has_calls() const { return has_calls_; }
  std::uint64_t get_calls() const { return get_calls_; }

  class Service;  // fake_peer.cc

 private:
  friend class Service;
  struct Held {
    std::string file, registration;
  };
  using Key = std::tuple<std::string, std::uint64_t, std::uint32_t>;
  std::shared_ptr<const Held> Find(const Key& key) const;

  const std::string address_;
  const Options options_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<const Held>> held_;
  std::atomic<std::uint64_t> puts_{0}, has_calls_{0}, get_calls_{0};
  std::atomic<bool> stopping_{false};
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
};

// A shard image with `info`'s identity and items (as ReadShardHeader gave them; the caller
// may change them: another world size, an extra item, another shape), its data from
// `data(item, out)` (which fills out, item.length bytes), every checksum (items, blocks,
// header) computed anew: a copy that passes every check a checksum makes.
std::string RebuildShard(const ShardInfo& info, const std::function<void(const ShardItem&, char*)>& data);
// The shard at `path` with every data byte changed (XOR 0x5a) and its checksums recomputed.
std::string ForgedShard(const std::string& path);

}  // namespace ckpt::test
