// What both ends of the Peer service (proto/ckpt/v1/peer.proto) agree on beyond the .proto:
// the two streaming calls registered by hand (their pieces are raw ByteBuffers,
// piece_wire.h), the sizes of pieces and messages, how a shard is named in messages and
// checked, and what a HasShard proof is bound to. Used by the server (peer_service.h) and
// the caller (replicator.h). Constants and stateless functions: safe from any thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace ckpt {

namespace v1 {
class HasShardReply;
class ListReplicasReply;
class ShardKey;
}  // namespace v1

// Bytes per streamed piece. A restore's fetch (GetShard) takes 4 MiB: a quarter of the
// per-piece work (a gRPC message, a flow-control round) for the same bytes. Replication
// (PutShard) keeps 1 MiB: the sender checks the trainer's pool before every piece, and
// gives way sooner between small ones.
inline constexpr std::uint64_t kFetchPiece = std::uint64_t{4} << 20;
inline constexpr std::uint64_t kReplicaPiece = std::uint64_t{1} << 20;
// The largest shard header accepted.
inline constexpr std::uint64_t kMaxShardHeader = std::uint64_t{64} << 20;
// The largest message either end takes. The largest piece is the first, which holds the
// whole header (up to kMaxShardHeader + 8) or kFetchPiece bytes; 1 MiB above that leaves room
// for the other fields.
inline constexpr int kMaxPeerMessage = static_cast<int>(std::max(kMaxShardHeader + 8, kFetchPiece) + (1 << 20));

// PutShard and GetShard by hand: their full names and their indexes in the generated
// Service, as peer.proto declares them.
inline constexpr char kPutShardMethod[] = "/ckpt.v1.Peer/PutShard";
inline constexpr char kGetShardMethod[] = "/ckpt.v1.Peer/GetShard";
inline constexpr int kPutShardMethodIndex = 0;
inline constexpr int kGetShardMethodIndex = 1;

// A peer that could not be reached or failed otherwise.
inline Status Unreachable(std::string m) { return {StatusCode::kIoError, std::move(m)}; }

// A channel to the peer daemon at `peer` ("HOST:PORT"): messages up to kMaxPeerMessage, and a
// short reconnect backoff, so that a dead peer is found out quickly and a restarted one is
// reached again at once.
std::shared_ptr<grpc::Channel> NewPeerChannel(const std::string& peer);

// "job J version V rank R", as messages name a shard.
std::string DescribeShard(const std::string& job, std::uint64_t version, std::uint32_t rank);

// InvalidArgument unless `key` names a shard: a valid job id, a version above 0.
Status CheckShardKey(const v1::ShardKey& key);

// What a HasShard reply says, as its proof is bound to it (PeerSecret::HasAnswer).
std::string HasAnswer(const std::string& subject, const v1::HasShardReply& reply);

// What a ListReplicas reply says (every key and size, in order), as its proof is bound to it.
std::string ListAnswer(const std::string& subject, const v1::ListReplicasReply& reply);

}  // namespace ckpt
