#include "daemon/replication/peer_protocol.h"

#include <grpcpp/grpcpp.h>

#include "ckpt/v1/peer.pb.h"
#include "common/names.h"
#include "daemon/base/peer_secret.h"

namespace ckpt {

std::shared_ptr<grpc::Channel> NewPeerChannel(const std::string& peer) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxPeerMessage);
  args.SetMaxSendMessageSize(kMaxPeerMessage);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(peer, grpc::InsecureChannelCredentials(), args);
}

std::string DescribeShard(const std::string& job, std::uint64_t version, std::uint32_t rank) {
  return "job " + job + " version " + std::to_string(version) + " rank " + std::to_string(rank);
}

Status CheckShardKey(const v1::ShardKey& key) {
  if (std::string why = CheckJobId(key.job()); !why.empty()) return InvalidArgument(why);
  if (key.version() == 0) return InvalidArgument("version 0 is not a version");
  return Status::Ok();
}

std::string HasAnswer(const std::string& subject, const v1::HasShardReply& reply) {
  return PeerSecret::HasAnswer(subject, reply.held(), reply.file_bytes(), reply.registration());
}

std::string ListAnswer(const std::string& subject, const v1::ListReplicasReply& reply) {
  std::string out = "list " + subject;
  for (const auto& r : reply.replicas()) {
    out += "\n" + std::to_string(r.key().version()) + " " + std::to_string(r.key().rank()) + " " +
           std::to_string(r.file_bytes());
  }
  return out;
}

}  // namespace ckpt
