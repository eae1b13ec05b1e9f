#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace ckpt {

Status IoError(const std::string& what, int err) {
  StatusCode code = (err == ENOSPC || err == EDQUOT) ? StatusCode::kResourceExhausted : StatusCode::kIoError;
  return Status(code, what + ": " + std::strerror(err));
}

int GrpcCodeNumber(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return 0;
    case StatusCode::kCancelled:
      return 1;
    case StatusCode::kIoError:
      return 2;
    case StatusCode::kInvalidArgument:
      return 3;
    case StatusCode::kDeadlineExceeded:
      return 4;
    case StatusCode::kNotFound:
      return 5;
    case StatusCode::kAlreadyExists:
      return 6;
    case StatusCode::kPermissionDenied:
      return 7;
    case StatusCode::kResourceExhausted:
      return 8;
    case StatusCode::kFailedPrecondition:
      return 9;
    case StatusCode::kAborted:
      return 10;
    case StatusCode::kInternal:
      return 13;
    case StatusCode::kDataLoss:
      return 15;
  }
  return 2;
}

}  // namespace ckpt
