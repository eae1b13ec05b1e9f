// The text of GET /metrics, the textfile and the GetMetrics call: the process's counters
// (daemon/metrics/daemon_metrics.h) and, read at render time from the parts that already
// keep them for the Status report, the pool, the memory tier, the sessions, the pending
// promotions and the restored bytes. Thread-safe.
#pragma once

#include <string>

#include "daemon/daemon.h"
#include "daemon/metrics/registry.h"

namespace ckpt::metrics {

// Content-Type of the text.
inline constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

// Series labelled job="..." are included only where `filter` allows (null: all).
std::string RenderMetrics(Daemon& daemon, const LabelFilter& filter = nullptr);

}  // namespace ckpt::metrics
