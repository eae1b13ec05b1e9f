// MetricsExport: what --metrics-listen and --metrics-textfile start, built from the config
// once the daemon serves: the HTTP endpoint and the textfile writer (either may be off).
// Start fails, naming the address or the path, if the port cannot be bound or the first
// textfile cannot be written. Destroyed before the daemon it renders.
#pragma once

#include <memory>

#include "common/status.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/metrics/http_endpoint.h"
#include "daemon/metrics/textfile_writer.h"

namespace ckpt::metrics {

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
