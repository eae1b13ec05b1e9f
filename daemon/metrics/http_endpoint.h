// MetricsHttpEndpoint: the HTTP side of --metrics-listen. GET (or HEAD) /metrics answers the
// text `render` returns, as text/plain; version=0.0.4; any other path is 404, any other
// method 405. One thread serves one connection at a time, each closed after its reply
// (Connection: close), with a deadline for the whole exchange so a stalled client holds the
// thread for at most kExchangeLimit. A scrape is a few per minute; this is all it needs.
//
// Why not cpp-httplib (libcpp-httplib-dev): Debian ships it as a shared library built with
// OpenSSL, zlib and brotli, which would all be loaded into the daemon for one plain-text
// page, and its bind reports failure as a bare `false`, where an operator needs the errno
// ("Address already in use"). Thread-safe; the destructor stops the thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/listen_address.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt::metrics {

class MetricsHttpEndpoint {
 public:
  static constexpr std::chrono::seconds kExchangeLimit{5};

  // Binds and listens on `address`; an error names the address and the reason (errno).
  static Result<std::unique_ptr<MetricsHttpEndpoint>> Start(const ListenAddress& address,
                                                            std::function<std::string()> render);
  ~MetricsHttpEndpoint();
  MetricsHttpEndpoint(const MetricsHttpEndpoint&) = delete;
  MetricsHttpEndpoint& operator=(const MetricsHttpEndpoint&) = delete;

  // The address as bound, with the port the kernel picked for port 0.
  const std::string& bound() const { return bound_; }

 private:
  MetricsHttpEndpoint(UniqueFd listener, UniqueFd stop_read, UniqueFd stop_write, std::string bound,
                      std::function<std::string()> render);
  void Loop();
  void Serve(int fd);

  UniqueFd listener_, stop_read_, stop_write_;
  const std::string bound_;
  const std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace ckpt::metrics
