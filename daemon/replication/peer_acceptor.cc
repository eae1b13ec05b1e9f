#include "daemon/replication/peer_acceptor.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ckpt {
namespace {

constexpr int kBatch = 256;  // connections accepted per wake-up

// Not listening where asked: the daemon does not start.
Status CannotListen(std::string m) { return {StatusCode::kIoError, std::move(m)}; }


// The remote address of a connection, without its port.
std::string RemoteAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, host, sizeof host);
  } else if (ss.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, host, sizeof host);
  }
  return host;
}

}  // namespace

PeerAcceptor::Limits PeerAcceptor::LimitsOf(std::uint32_t max_connections, std::uint32_t max_per_address) {
  Limits limits;
  limits.per_address = max_per_address;
  limits.total = max_connections;
  if (limits.total == 0) {
    rlimit lim{};
    const rlim_t open_files = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? lim.rlim_cur : 1024;
    limits.total = static_cast<std::uint32_t>(std::clamp<rlim_t>(open_files / 4, 16, 4096));
  }
  return limits;
}

Result<std::unique_ptr<PeerAcceptor>> PeerAcceptor::Start(const std::string& listen, Limits limits,
                                                          std::function<void(int)> hand_over) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("--peer-listen " + listen + " is not ADDR:PORT");
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return CannotListen("--peer-listen " + listen + ": " + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> keep(found, &::freeaddrinfo);
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!fd.valid()) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    const int p = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return std::unique_ptr<PeerAcceptor>(new PeerAcceptor(std::move(fd), p, limits, std::move(hand_over)));
  }
  return CannotListen("--peer-listen " + listen + ": cannot listen there (" + why + ")");
}

PeerAcceptor::PeerAcceptor(UniqueFd listener, int port, Limits limits, std::function<void(int)> hand_over)
    : listener_(std::move(listener)),
      port_(port),
      limits_(limits),
      hand_over_(std::move(hand_over)) {
  int pipe[2];
  if (::pipe2(pipe, O_CLOEXEC) == 0) {
    stop_read_.reset(pipe[0]);
    stop_write_.reset(pipe[1]);
  }
  thread_ = std::thread([this] { Loop(); });
}

PeerAcceptor::~PeerAcceptor() {
  stop_write_.reset();  // the loop sees the pipe's end
  if (thread_.joinable()) thread_.join();
}

std::size_t PeerAcceptor::Held() {
  MutexLock lock(mu_);
  SweepClosed();
  return by_fd_.size();
}

void PeerAcceptor::Loop() {
  bool back_off = false;
  for (;;) {
    pollfd fds[2] = {{back_off ? -1 : listener_.get(), POLLIN, 0}, {stop_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, back_off ? 100 : -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    back_off = false;
    if (fds[0].revents & POLLIN) AcceptPending();
    back_off = !reserve_.Refill();
  }
}

void PeerAcceptor::Forget(std::map<int, Entry>::iterator it) {
  auto count = per_address_.find(it->second.address);
  if (count != per_address_.end() && --count->second == 0) per_address_.erase(count);
  by_fd_.erase(it);
}

void PeerAcceptor::SweepClosed() {
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    struct stat st {};
    auto next = std::next(it);
    if (::fstat(it->first, &st) != 0 || st.st_ino != it->second.ino || st.st_dev != it->second.dev) Forget(it);
    it = next;
  }
}

std::string PeerAcceptor::LimitPassed(const std::string& address) {
  if (limits_.total != 0 && by_fd_.size() >= limits_.total) {
    return "the peer server holds " + std::to_string(by_fd_.size()) + " connections, the most " +
           "--peer-max-connections (" + std::to_string(limits_.total) + ") allows; refused one from " + address;
  }
  auto it = per_address_.find(address);
  if (limits_.per_address != 0 && it != per_address_.end() && it->second >= limits_.per_address) {
    return address + " holds " + std::to_string(it->second) +
           " connections to the peer server, the most --peer-max-connections-per-address (" +
           std::to_string(limits_.per_address) + ") allows; refused another";
  }
  return {};
}

void PeerAcceptor::AcceptPending() {
  for (int i = 0; i < kBatch; ++i) {
    Accepted accepted = AcceptOne(listener_.get());
    if (accepted.outcome == AcceptOutcome::kTransient) continue;
    if (accepted.outcome == AcceptOutcome::kOutOfDescriptors) {
      reserve_.Shed(listener_.get());  // the loop backs off if the reserve is not back
      refused_log_.Warn(std::string("peer server out of file descriptors (") + std::strerror(accepted.error) +
                        "): refused a connection; lower --peer-max-connections or raise LimitNOFILE=");
    }
    if (accepted.outcome != AcceptOutcome::kAccepted) return;  // drained, or try at the next wake-up
    const int conn = accepted.fd.release();
    const std::string address = RemoteAddress(conn);
    struct stat st {};
    ::fstat(conn, &st);
    std::string passed;
    {
      MutexLock lock(mu_);
      if (auto it = by_fd_.find(conn); it != by_fd_.end()) Forget(it);  // a number gRPC closed and reused
      if (!LimitPassed(address).empty()) SweepClosed();
      passed = LimitPassed(address);
      if (passed.empty()) {
        ++per_address_[address];
        by_fd_[conn] = Entry{address, st.st_dev, st.st_ino};
      }
    }
    if (!passed.empty()) {
      ::close(conn);
      refused_log_.Warn("peer: " + passed);
      continue;
    }
    const int one = 1;
    ::setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    hand_over_(conn);
  }
}

}  // namespace ckpt
