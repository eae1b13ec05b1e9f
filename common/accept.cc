#include "common/accept.h"

#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>

namespace ckpt {
namespace {

UniqueFd MakeReserve() { return UniqueFd(::eventfd(0, EFD_CLOEXEC)); }

}  // namespace

Accepted AcceptOne(int listener) {
  Accepted out;
  out.fd = UniqueFd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (out.fd.valid()) {
    out.outcome = AcceptOutcome::kAccepted;
    return out;
  }
  out.error = errno;
  switch (out.error) {
    case EAGAIN:
#if EAGAIN != EWOULDBLOCK
    case EWOULDBLOCK:
#endif
      out.outcome = AcceptOutcome::kDrained;
      break;
    case EINTR:
    case ECONNABORTED:
    case EPROTO:
      out.outcome = AcceptOutcome::kTransient;
      break;
    case EMFILE:
    case ENFILE:
      out.outcome = AcceptOutcome::kOutOfDescriptors;
      break;
    case ENOBUFS:
    case ENOMEM:
      out.outcome = AcceptOutcome::kOutOfMemory;
      break;
    default:
      out.outcome = AcceptOutcome::kFailed;
      break;
  }
  return out;
}

DescriptorReserve::DescriptorReserve() : fd_(MakeReserve()) {}

bool DescriptorReserve::Shed(int listener) {
  fd_.reset();
  bool shed = false;
  {
    // Closed before the reserve is taken back: at the limit, the reserve needs the number
    // the shed connection held.
    UniqueFd conn(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    shed = conn.valid();
  }
  fd_ = MakeReserve();
  return shed && fd_.valid();
}

bool DescriptorReserve::Refill() {
  if (!fd_.valid()) fd_ = MakeReserve();
  return fd_.valid();
}

}  // namespace ckpt
