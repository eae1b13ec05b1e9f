#include "daemon/rpc/acceptor.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace ckpt {
namespace {

// Connections accepted per AcceptPending call.
constexpr int kBatch = 256;

UniqueFd MakeReserve() { return UniqueFd(::eventfd(0, EFD_CLOEXEC)); }

// The peer's supplementary groups (Linux 4.13+); none where the kernel cannot tell.
std::vector<gid_t> PeerGroups(int fd) {
  std::vector<gid_t> groups(16);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE) break;
    groups.resize(len / sizeof(gid_t) + 1);
  }
  return {};
}

}  // namespace

Acceptor::Acceptor(int listen_fd, PeerRegistry& peers, std::function<void(int fd)> hand_over)
    : listen_fd_(listen_fd), peers_(peers), hand_over_(std::move(hand_over)), reserve_(MakeReserve()) {}

bool Acceptor::Shed(int err) {
  reserve_.reset();
  int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (conn >= 0) ::close(conn);
  reserve_ = MakeReserve();
  exhausted_log_.Warn(std::string("out of file descriptors (") + std::strerror(err) +
                      "): refused a connection; raise the open-file limit (LimitNOFILE=) or lower the "
                      "connection limits");
  return conn >= 0 && reserve_.valid();
}

bool Acceptor::AcceptPending() {
  for (int i = 0; i < kBatch; ++i) {
    int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      switch (errno) {
        case EAGAIN:
#if EAGAIN != EWOULDBLOCK
        case EWOULDBLOCK:
#endif
          return true;
        case EINTR:
        case ECONNABORTED:
        case EPROTO:
          continue;
        case EMFILE:
        case ENFILE:
          if (!Shed(errno)) return false;
          continue;
        default:  // ENOBUFS, ENOMEM: the kernel is short of memory
          exhausted_log_.Warn(std::string("accept failed: ") + std::strerror(errno));
          return false;
      }
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      ::close(conn);
      continue;
    }
    if (Status st = peers_.Add(conn, PeerCredentials{cred.pid, cred.uid, cred.gid, PeerGroups(conn)});
        !st.ok()) {
      ::close(conn);
      limit_log_.Warn(st.message());
      continue;
    }
    hand_over_(conn);
  }
  return true;
}

}  // namespace ckpt
