// How libckpt reports a failure: as the ckpt::Error the public API promises (ckpt/client.h),
// whose code() is a gRPC status code. A failed RPC keeps the daemon's code and message; a
// local failure (a region, the descriptor table) is FAILED_PRECONDITION unless the status
// carries a code of its own that the caller must see (ThrowWithCode). Private to libckpt.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "ckpt/client.h"
#include "common/status.h"

namespace ckpt {

// A failed RPC: `what` (the call, for the message), then the daemon's message.
[[noreturn]] inline void Throw(const grpc::Status& s, const std::string& what) {
  std::string msg = what + ": " + s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) msg += " (is ckptd running?)";
  throw Error(static_cast<int>(s.error_code()), msg);
}

[[noreturn]] inline void Throw(const Status& s) {
  throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION), s.message());
}

[[noreturn]] inline void ThrowWithCode(const Status& s) {
  throw Error(GrpcCodeNumber(s.code()), s.message());
}

}  // namespace ckpt
