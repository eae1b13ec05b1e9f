// MetricsHttpEndpoint: the HTTP side of --metrics-listen. GET (or HEAD) /metrics answers the
// text `render` returns, as text/plain; version=0.0.4; any other path is 404, any other
// method 405. Each connection gets one reply and is closed (Connection: close).
//
// One thread serves every connection at once from one poll loop, each with its own buffer
// and a deadline of kExchangeLimit for the whole exchange (then 408 and closed), so a client
// that stalls delays nobody else's scrape. At most kMaxConnections are open: a new one past
// that closes the oldest, with a 503, so a crowd of stalled clients holds a bounded number
// of descriptors and cannot keep a scrape out. Lines may end in CRLF or a bare LF. When the
// process is out of descriptors (EMFILE, ENFILE) the listener is left out of the poll for
// kAcceptBackoff instead of being retried at once, forever; the pending connections wait in
// the backlog.
//
// Why not cpp-httplib (libcpp-httplib-dev): Debian ships it as a shared library built with
// OpenSSL, zlib and brotli, which would all be loaded into the daemon for one plain-text
// page, and its bind reports failure as a bare `false`, where an operator needs the errno
// ("Address already in use"). Thread-safe; the destructor stops the thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/listen_address.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt::metrics {

class MetricsHttpEndpoint {
 public:
  static constexpr std::chrono::seconds kExchangeLimit{5};
  static constexpr std::size_t kMaxConnections = 64;
  static constexpr std::chrono::milliseconds kAcceptBackoff{100};

  // A listening socket on `address`, as Start makes it (--check-config binds it and closes
  // it). An error names the address and the reason (errno): EADDRINUSE, which a restart
  // may cure, and other failures of the system are IoError; an address this host cannot
  // bind (EADDRNOTAVAIL, EACCES, no IPv6) is InvalidArgument, a configuration error.
  static Result<UniqueFd> Listen(const ListenAddress& address);
  // Listen, then serve on a thread of its own.
  static Result<std::unique_ptr<MetricsHttpEndpoint>> Start(const ListenAddress& address,
                                                            std::function<std::string()> render);
  ~MetricsHttpEndpoint();
  MetricsHttpEndpoint(const MetricsHttpEndpoint&) = delete;
  MetricsHttpEndpoint& operator=(const MetricsHttpEndpoint&) = delete;

  // The address as bound, with the port the kernel picked for port 0.
  const std::string& bound() const { return bound_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Connection {
    UniqueFd fd;
    Clock::time_point deadline;
    std::string request;  // bytes read so far
    std::string reply;    // once the request is whole
    std::size_t sent = 0;
    bool done = false;
  };

  MetricsHttpEndpoint(UniqueFd listener, UniqueFd stop_read, UniqueFd stop_write, std::string bound,
                      std::function<std::string()> render);
  void Loop();
  // Accepts what is pending into `connections`; false when out of descriptors (back off).
  bool AcceptPending(std::vector<Connection>& connections);
  // Reads or writes what the socket allows; sets `done` when the exchange is over.
  void Progress(Connection& c);
  std::string Respond(const std::string& request) const;
  // A warning at most once a second (the states that cause them can last).
  void ThrottledWarn(const std::string& line);

  UniqueFd listener_, stop_read_, stop_write_;
  const std::string bound_;
  const std::function<std::string()> render_;
  Clock::time_point last_warning_{};  // the loop's thread only
  std::thread thread_;
};

}  // namespace ckpt::metrics
