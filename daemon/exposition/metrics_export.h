// MetricsExport: what --metrics-listen and --metrics-textfile start, built from the config
// once the daemon serves: the HTTP endpoint and the textfile writer (either may be off).
// Start fails, naming the address or the path, if the port cannot be bound or the first
// textfile cannot be written: InvalidArgument (a configuration error, exit 2) for an
// address this host cannot listen on and for a textfile whose directory is missing, not a
// directory or not writable; another code (a runtime failure, exit 1) for a port in use and
// a failed write. Destroyed before the daemon it renders.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "daemon/base/config.h"
#include "daemon/daemon.h"
#include "daemon/exposition/http_endpoint.h"
#include "daemon/exposition/textfile_writer.h"

namespace ckpt::metrics {

// --check-config's part: the configuration errors Start would report, without starting
// anything (the address is bound and closed at once). A port in use is no error here, as the
// running daemon may hold it: it is described in *warning instead.
Status CheckMetricsConfig(const Config& config, std::string* warning);

class MetricsExport {
 public:
  static Result<std::unique_ptr<MetricsExport>> Start(const Config& config, Daemon& daemon);
  // Writes the textfile a last time (call after the daemon finished its shards) and stops
  // serving. Idempotent.
  void Stop();

 private:
  std::unique_ptr<MetricsHttpEndpoint> http_;
  std::unique_ptr<TextfileWriter> textfile_;
};

}  // namespace ckpt::metrics
