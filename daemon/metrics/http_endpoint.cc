#include "daemon/metrics/http_endpoint.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "daemon/metrics/exposition.h"

namespace ckpt::metrics {
namespace {

constexpr std::size_t kMaxRequestBytes = 8192;

// Waits for `events` on fd until `deadline`; false on timeout or error.
bool PollUntil(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

bool SendAll(int fd, const std::string& data, std::chrono::steady_clock::time_point deadline) {
  std::size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!PollUntil(fd, POLLOUT, deadline)) return false;
    } else {
      return false;
    }
  }
  return true;
}

std::string Reply(const std::string& status, const std::string& content_type, const std::string& body,
                  bool head, const std::string& extra_headers = "") {
  return "HTTP/1.1 " + status + "\r\nContent-Type: " + content_type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers +
         "Connection: close\r\n\r\n" + (head ? std::string() : body);
}

}  // namespace

Result<std::unique_ptr<MetricsHttpEndpoint>> MetricsHttpEndpoint::Start(const ListenAddress& address,
                                                                        std::function<std::string()> render) {
  const std::string wanted = FormatListenAddress(address.addr);
  UniqueFd fd(::socket(address.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return IoError("metrics listener " + wanted + ": socket", errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (address.addr.ss_family == AF_INET6) {
    // [::] means IPv6 only here, as written; 0.0.0.0 is the way to ask for IPv4.
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  }
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address.addr), address.len) != 0) {
    return IoError("metrics listener: bind " + wanted, errno);
  }
  if (::listen(fd.get(), 16) != 0) return IoError("metrics listener: listen on " + wanted, errno);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return IoError("metrics listener: getsockname of " + wanted, errno);
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return IoError("metrics listener: pipe", errno);
  return std::unique_ptr<MetricsHttpEndpoint>(
      new MetricsHttpEndpoint(std::move(fd), UniqueFd(pipe_fds[0]), UniqueFd(pipe_fds[1]),
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

void MetricsHttpEndpoint::Loop() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics listener {}: poll: {}; no more scrapes are served", bound_,
                    std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    UniqueFd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (conn.valid()) Serve(conn.get());
  }
}

void MetricsHttpEndpoint::Serve(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kExchangeLimit;
  std::string request;
  while (request.find("\r\n\r\n") == std::string::npos) {
    if (request.size() > kMaxRequestBytes) {
      SendAll(fd, Reply("431 Request Header Fields Too Large", "text/plain", "request too large\n", false),
              deadline);
      return;
    }
    char buf[2048];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      request.append(buf, static_cast<std::size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!PollUntil(fd, POLLIN, deadline)) return;
    } else {
      return;  // closed before a whole request
    }
  }
  // Request line: METHOD SP TARGET SP VERSION.
  const std::string line = request.substr(0, request.find("\r\n"));
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    SendAll(fd, Reply("400 Bad Request", "text/plain", "malformed request line\n", false), deadline);
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));  // Prometheus may add parameters
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    SendAll(
        fd,
        Reply("405 Method Not Allowed", "text/plain", "only GET and HEAD\n", false, "Allow: GET, HEAD\r\n"),
        deadline);
    return;
  }
  if (target != "/metrics") {
    SendAll(
        fd,
        Reply("404 Not Found", "text/plain", "not found: " + target + " (metrics are at /metrics)\n", head),
        deadline);
    return;
  }
  SendAll(fd, Reply("200 OK", kContentType, render_(), head), deadline);
}

}  // namespace ckpt::metrics
