#include "daemon/exposition/http_endpoint.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/accept.h"
#include "daemon/exposition/exposition.h"

namespace ckpt::metrics {
namespace {

constexpr std::size_t kMaxRequestBytes = 8192;

std::string Reply(const std::string& status, const std::string& content_type, const std::string& body,
                  bool head, const std::string& extra_headers = "") {
  return "HTTP/1.1 " + status + "\r\nContent-Type: " + content_type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers +
         "Connection: close\r\n\r\n" + (head ? std::string() : body);
}

// The end of the request's header: its first empty line, the line ends CRLF or bare LF
// (RFC 9112 section 2.2 lets a server take a bare LF as a line end).
bool HeaderComplete(const std::string& request) {
  return request.find("\n\n") != std::string::npos || request.find("\n\r\n") != std::string::npos;
}

// A reply sent once, as far as the socket takes it without waiting, before the connection
// is closed: for a client that is dropped, so that it can tell why.
void SendParting(int fd, const std::string& status, const std::string& body) {
  const std::string reply = Reply(status, "text/plain", body, false);
  [[maybe_unused]] ssize_t n = ::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// What errno of socket() or bind() says about the address: one that this host cannot
// listen on is a configuration error (a restart does not help); a port in use may be
// free again later, and the rest are failures of the system.
Status ListenError(const std::string& what, int err) {
  if (err == EADDRINUSE || err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
    return IoError(what, err);
  }
  std::string hint;
  if (err == EADDRNOTAVAIL) hint = " (not an address of this host)";
  if (err == EACCES) hint = " (a port below 1024 needs root or CAP_NET_BIND_SERVICE)";
  if (err == EAFNOSUPPORT) hint = " (IPv6 is not available on this host)";
  return InvalidArgument(what + ": " + std::strerror(err) + hint);
}

}  // namespace

Result<UniqueFd> MetricsHttpEndpoint::Listen(const ListenAddress& address) {
  const std::string wanted = FormatListenAddress(address.addr);
  UniqueFd fd(::socket(address.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ListenError("metrics listener " + wanted + ": socket", errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (address.addr.ss_family == AF_INET6) {
    // [::] means IPv6 only here, as written; 0.0.0.0 is the way to ask for IPv4.
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  }
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address.addr), address.len) != 0) {
    return ListenError("metrics listener: bind " + wanted, errno);
  }
  if (::listen(fd.get(), static_cast<int>(kMaxConnections)) != 0) {
    return IoError("metrics listener: listen on " + wanted, errno);
  }
  return fd;
}

Result<std::unique_ptr<MetricsHttpEndpoint>> MetricsHttpEndpoint::Start(const ListenAddress& address,
                                                                        std::function<std::string()> render) {
  auto fd = Listen(address);
  if (!fd.ok()) return fd.status();
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(fd->get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return IoError("metrics listener: getsockname of " + FormatListenAddress(address.addr), errno);
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return IoError("metrics listener: pipe", errno);
  return std::unique_ptr<MetricsHttpEndpoint>(
      new MetricsHttpEndpoint(std::move(fd).value(), UniqueFd(pipe_fds[0]), UniqueFd(pipe_fds[1]),
                              FormatListenAddress(bound), std::move(render)));
}

MetricsHttpEndpoint::MetricsHttpEndpoint(UniqueFd listener, UniqueFd stop_read, UniqueFd stop_write,
                                         std::string bound, std::function<std::string()> render)
    : listener_(std::move(listener)),
      stop_read_(std::move(stop_read)),
      stop_write_(std::move(stop_write)),
      bound_(std::move(bound)),
      render_(std::move(render)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpEndpoint::~MetricsHttpEndpoint() {
  stop_write_.reset();  // the loop sees the pipe's end
  if (thread_.joinable()) thread_.join();
}

void MetricsHttpEndpoint::ThrottledWarn(const std::string& line) {
  const auto now = Clock::now();
  if (now - last_warning_ < std::chrono::seconds(1)) return;
  last_warning_ = now;
  spdlog::warn("metrics listener {}: {}", bound_, line);
}

void MetricsHttpEndpoint::Loop() {
  std::vector<Connection> connections;  // oldest first
  Clock::time_point accept_again{};     // until then the listener is left out (out of descriptors)
  std::vector<pollfd> fds;
  auto drop_done = [&connections] {
    connections.erase(
        std::remove_if(connections.begin(), connections.end(), [](const Connection& c) { return c.done; }),
        connections.end());
  };
  for (;;) {
    const auto now = Clock::now();
    for (auto& c : connections) {
      if (c.deadline > now) continue;
      if (c.reply.empty()) SendParting(c.fd.get(), "408 Request Timeout", "request not complete in time\n");
      c.done = true;
    }
    drop_done();
    const bool listening = now >= accept_again;
    auto wake = listening ? Clock::time_point::max() : accept_again;
    fds.assign({{stop_read_.get(), POLLIN, 0}, {listening ? listener_.get() : -1, POLLIN, 0}});
    for (const auto& c : connections) {
      fds.push_back({c.fd.get(), static_cast<short>(c.reply.empty() ? POLLIN : POLLOUT), 0});
      wake = std::min(wake, c.deadline);
    }
    // Rounded up: a wake-up a little before a deadline would only poll again at once.
    const int timeout_ms =
        wake == Clock::time_point::max()
            ? -1
            : static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(wake - now).count());
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics listener {}: poll: {}; no more scrapes are served", bound_,
                    std::strerror(errno));
      return;
    }
    if (fds[0].revents) return;
    for (std::size_t i = 0; i < connections.size(); ++i) {
      if (fds[i + 2].revents) Progress(connections[i]);
    }
    drop_done();
    if ((fds[1].revents & POLLIN) && !AcceptPending(connections))
      accept_again = Clock::now() + kAcceptBackoff;
  }
}

bool MetricsHttpEndpoint::AcceptPending(std::vector<Connection>& connections) {
  // A batch at most, so that the connections open are served between two batches.
  for (std::size_t i = 0; i < kMaxConnections; ++i) {
    Accepted accepted = AcceptOne(listener_.get());
    switch (accepted.outcome) {
      case AcceptOutcome::kAccepted:
        break;
      case AcceptOutcome::kTransient:
        continue;
      case AcceptOutcome::kOutOfDescriptors:
      case AcceptOutcome::kOutOfMemory:
        ThrottledWarn(std::string("out of file descriptors or memory (") + std::strerror(accepted.error) +
                      "): not accepting scrapes for " + std::to_string(kAcceptBackoff.count()) +
                      " ms; raise the open-file limit (LimitNOFILE=)");
        return false;
      case AcceptOutcome::kDrained:
      case AcceptOutcome::kFailed:
        return true;
    }
    UniqueFd fd = std::move(accepted.fd);
    if (connections.size() >= kMaxConnections) {
      SendParting(connections.front().fd.get(), "503 Service Unavailable",
                  "too many connections: the oldest is closed\n");
      connections.erase(connections.begin());
      ThrottledWarn("more than " + std::to_string(kMaxConnections) +
                    " connections open (clients that do not finish their requests?): closing the oldest");
    }
    Connection& c = connections.emplace_back();
    c.fd = std::move(fd);
    c.deadline = Clock::now() + kExchangeLimit;
  }
  return true;
}

void MetricsHttpEndpoint::Progress(Connection& c) {
  while (c.reply.empty()) {
    char buf[2048];
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      c.done = true;  // closed (or failed) before a whole request
      return;
    }
    c.request.append(buf, static_cast<std::size_t>(n));
    if (HeaderComplete(c.request)) {
      c.reply = Respond(c.request);
    } else if (c.request.size() > kMaxRequestBytes) {
      c.reply = Reply("431 Request Header Fields Too Large", "text/plain", "request too large\n", false);
    }
  }
  while (c.sent < c.reply.size()) {
    const ssize_t n =
        ::send(c.fd.get(), c.reply.data() + c.sent, c.reply.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) break;
    c.sent += static_cast<std::size_t>(n);
  }
  c.done = true;
}

std::string MetricsHttpEndpoint::Respond(const std::string& request) const {
  // Request line: METHOD SP TARGET SP VERSION.
  std::string line = request.substr(0, request.find('\n'));
  if (!line.empty() && line.back() == '\r') line.pop_back();
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos)
    return Reply("400 Bad Request", "text/plain", "malformed request line\n", false);
  const std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));  // Prometheus may add parameters
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    return Reply("405 Method Not Allowed", "text/plain", "only GET and HEAD\n", false,
                 "Allow: GET, HEAD\r\n");
  }
  if (target != "/metrics") {
    return Reply("404 Not Found", "text/plain", "not found: " + target + " (metrics are at /metrics)\n",
                 head);
  }
  return Reply("200 OK", kContentType, render_(), head);
}

}  // namespace ckpt::metrics
