#include "daemon/exposition/metrics_export.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "daemon/exposition/exposition.h"

namespace ckpt::metrics {
namespace {

// The textfile's directory exists and this process may create files in it. Missing, it
// is most likely node_exporter's not set up yet: a start would fail at its first write,
// and a restart would fail the same way.
Status CheckTextfileDir(Storage& storage, const std::string& path) {
  const std::string dir = path.substr(0, std::max<std::size_t>(path.find_last_of('/'), 1));
  if (!storage.Exists(dir)) return InvalidArgument("directory " + dir + " does not exist");
  if (auto listed = storage.List(dir); !listed.ok()) {
    return InvalidArgument(dir + " is not a directory ckptd can write in: " + listed.status().message());
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return InvalidArgument("directory " + dir + " is not writable by uid " + std::to_string(::geteuid()) +
                           ": " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace

Status CheckMetricsConfig(const Config& config, std::string* warning) {
  if (!config.metrics_listen.empty()) {
    auto address = ParseListenAddress(config.metrics_listen);  // checked by ParseConfig already
    if (!address.ok()) return address.status();
    if (auto probe = MetricsHttpEndpoint::Listen(address.value()); !probe.ok()) {
      Status s = probe.status().With("--metrics-listen " + config.metrics_listen);
      if (s.code() == StatusCode::kInvalidArgument) return s;
      *warning = s.message() + " (by the running daemon?): a start now would fail with exit 1";
    }
  }
  if (!config.metrics_textfile.empty()) {
    PosixStorage posix;
    if (Status s = CheckTextfileDir(posix, config.metrics_textfile); !s.ok()) {
      return s.With("--metrics-textfile " + config.metrics_textfile);
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<MetricsExport>> MetricsExport::Start(const Config& config, Daemon& daemon) {
  auto out = std::make_unique<MetricsExport>();
  auto render = [&daemon] { return RenderMetrics(daemon); };
  if (!config.metrics_listen.empty()) {
    auto address = ParseListenAddress(config.metrics_listen);  // checked by ParseConfig already
    if (!address.ok()) return address.status();
    auto http = MetricsHttpEndpoint::Start(address.value(), render);
    if (!http.ok()) return http.status().With("--metrics-listen " + config.metrics_listen);
    out->http_ = std::move(http).value();
    spdlog::info("metrics on http://{}/metrics", out->http_->bound());
  }
  if (!config.metrics_textfile.empty()) {
    auto storage = std::make_shared<PosixStorage>();
    if (Status s = CheckTextfileDir(*storage, config.metrics_textfile); !s.ok()) {
      return s.With("--metrics-textfile " + config.metrics_textfile);
    }
    out->textfile_ = std::make_unique<TextfileWriter>(
        storage, config.metrics_textfile, std::chrono::seconds(config.metrics_interval_s), render);
    if (Status s = out->textfile_->Start(); !s.ok()) return s.With("--metrics-textfile");
    spdlog::info("metrics written to {} every {} s", config.metrics_textfile, config.metrics_interval_s);
  }
  return out;
}

void MetricsExport::Stop() {
  if (textfile_) textfile_->Stop();
  http_.reset();
}

}  // namespace ckpt::metrics
