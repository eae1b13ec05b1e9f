#include "proto/grpc_status.h"

namespace ckpt {

grpc::Status ToGrpc(const Status& s, GrpcService service) {
  if (s.ok()) return grpc::Status::OK;
  if (service == GrpcService::kPeer && s.code() == StatusCode::kPermissionDenied) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, s.message());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(GrpcCodeNumber(s.code())), s.message());
}

Status FromGrpc(const grpc::Status& st, const std::string& what) {
  if (st.ok()) return Status::Ok();
  std::string m = what + ": " + st.error_message();
  switch (st.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
      return NotFound(std::move(m));
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return ResourceExhausted(std::move(m));
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return PermissionDenied(std::move(m));
    case grpc::StatusCode::DATA_LOSS:
      return DataLoss(std::move(m));
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return DeadlineExceeded(std::move(m));
    case grpc::StatusCode::FAILED_PRECONDITION:
      return FailedPrecondition(std::move(m));
    default:
      return Status(StatusCode::kIoError, std::move(m));
  }
}

}  // namespace ckpt
