#include "daemon/metrics/metrics_export.h"

#include <spdlog/spdlog.h>

#include "daemon/metrics/exposition.h"

namespace ckpt::metrics {

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
    out->textfile_ =
        std::make_unique<TextfileWriter>(std::make_shared<PosixStorage>(), config.metrics_textfile,
                                         std::chrono::seconds(config.metrics_interval_s), render);
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
