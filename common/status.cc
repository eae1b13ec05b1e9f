#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace ckpt {

Status IoError(const std::string& what, int err) {
  StatusCode code = (err == ENOSPC || err == EDQUOT) ? StatusCode::kResourceExhausted
                                                     : StatusCode::kIoError;
  return Status(code, what + ": " + std::strerror(err));
}

}  // namespace ckpt
