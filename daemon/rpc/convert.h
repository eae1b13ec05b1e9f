// The edge between the wire (ckpt.v1) and the daemon's own types: every translation of a
// request into the parts' inputs and of their results into replies happens here. Levels use
// proto/level_codec.h; a Status becomes a gRPC status by proto/grpc_status.h's ToGrpc.
#pragma once

#include <grpcpp/grpcpp.h>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "common/status.h"
#include "daemon/session/admission.h"
#include "daemon/session/registrar.h"
#include "daemon/session/restorer.h"
#include "daemon/pipeline/tier_set.h"
#include "proto/grpc_status.h"

namespace ckpt {

RegistrationRequest FromProto(const v1::RegisterRequest& req);
// Copies the blobs' bytes (once): the shard keeps them until it is written.
SnapshotRequestData FromProto(const v1::SnapshotRequest& req);

void ToProto(const Registered& r, v1::RegisterReply* reply);
void ToProto(Restored r, v1::RestoreReply* reply);
void ToProto(std::uint64_t version, const VersionOnTiers& v, v1::VersionInfo* out);
void ToProto(const PrefetchResult& r, v1::PrefetchReply* reply);

}  // namespace ckpt
