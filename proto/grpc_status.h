// The one translation between ckpt::Status (common/status.h) and grpc::Status, for both
// services of proto/ckpt/v1: Checkpoint (trainer <-> daemon) and Peer (daemon <-> daemon).
// The code numbers are common/status.h's GrpcCodeNumber, which the client library and the
// Python module use too; the one place the two services differ is kPermissionDenied (see
// GrpcService). Stateless functions: safe from any thread.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "common/status.h"

namespace ckpt {

// Which service answers. The Peer service refuses with kPermissionDenied a call whose token
// of the shared secret is missing, wrong or replayed, or whose shard image carries no valid
// MAC: the caller did not authenticate, which gRPC calls UNAUTHENTICATED, and that is the code
// the peer tests expect (FromGrpc reads either as kPermissionDenied). On Checkpoint the caller
// is known (its uid, from the Unix socket) and may not do what it asked: PERMISSION_DENIED,
// as GrpcCodeNumber says, which the client and its tests expect.
enum class GrpcService { kCheckpoint, kPeer };

// `s` as the gRPC status a `service` handler returns: the same message, its code by
// GrpcCodeNumber (kIoError is UNKNOWN), except kPermissionDenied on kPeer. (The Peer
// handlers refuse with kInvalidArgument, kNotFound, kResourceExhausted, kDataLoss,
// kFailedPrecondition (a delta whose base the receiver does not hold) and kPermissionDenied
// only; FromGrpc reads any code it does not keep as kIoError.)
grpc::Status ToGrpc(const Status& s, GrpcService service = GrpcService::kCheckpoint);

// The inverse, for a caller reading a Peer call's status: `what: message` with the code the
// caller acts on kept (NOT_FOUND, RESOURCE_EXHAUSTED, DATA_LOSS, DEADLINE_EXCEEDED;
// UNAUTHENTICATED and PERMISSION_DENIED both as kPermissionDenied). Every other code is the
// callee failing or not reached: kIoError.
Status FromGrpc(const grpc::Status& st, const std::string& what);

}  // namespace ckpt
