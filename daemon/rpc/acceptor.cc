#include "daemon/rpc/acceptor.h"

#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "common/accept.h"

namespace ckpt {
namespace {

// Connections accepted per AcceptPending call.
constexpr int kBatch = 256;

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
    : listen_fd_(listen_fd), peers_(peers), hand_over_(std::move(hand_over)) {}

bool Acceptor::AcceptPending() {
  for (int i = 0; i < kBatch; ++i) {
    Accepted accepted = AcceptOne(listen_fd_);
    switch (accepted.outcome) {
      case AcceptOutcome::kAccepted:
        break;
      case AcceptOutcome::kDrained:
        return true;
      case AcceptOutcome::kTransient:
        continue;
      case AcceptOutcome::kOutOfDescriptors: {
        const bool shed = reserve_.Shed(listen_fd_);
        exhausted_log_.Warn(std::string("out of file descriptors (") + std::strerror(accepted.error) +
                            "): refused a connection; raise the open-file limit (LimitNOFILE=) or lower the "
                            "connection limits");
        if (!shed) return false;
        continue;
      }
      case AcceptOutcome::kOutOfMemory:
      case AcceptOutcome::kFailed:
        exhausted_log_.Warn(std::string("accept failed: ") + std::strerror(accepted.error));
        return false;
    }
    const int conn = accepted.fd.release();
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
