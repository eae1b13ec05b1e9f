#include "daemon/metrics/registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ckpt::metrics {
namespace {

// Adds to an atomic double (fetch_add on floating-point atomics is C++20, but not yet
// lock-free everywhere; a compare-exchange loop is).
void AtomicAdd(std::atomic<double>& a, double d) {
  double old = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(old, old + d, std::memory_order_relaxed)) {
  }
}

// The format's spelling of a float: Go's ParseFloat reads what %.17g writes, and the three
// special values have their own names.
std::string FormatDouble(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // The shortest of %.15g and %.17g that reads back as v: bucket bounds stay "0.1", not
  // "0.10000000000000001".
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

std::string Exposition::EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

void Exposition::Header(const std::string& name, const std::string& type, const std::string& help) {
  // In HELP text only backslash and line feed are escaped.
  std::string escaped;
  for (char c : help) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '\n') {
      escaped += "\\n";
    } else {
      escaped += c;
    }
  }
  text_ += "# HELP " + name + " " + escaped + "\n# TYPE " + name + " " + type + "\n";
}

void Exposition::Series(const std::string& name, const Labels& labels) {
  text_ += name;
  if (!labels.empty()) {
    text_ += '{';
    for (std::size_t i = 0; i < labels.size(); ++i) {
      if (i) text_ += ',';
      text_ += labels[i].first + "=\"" + EscapeLabelValue(labels[i].second) + '"';
    }
    text_ += '}';
  }
  text_ += ' ';
}

void Exposition::Sample(const std::string& name, const Labels& labels, double value) {
  Series(name, labels);
  text_ += FormatDouble(value) + "\n";
}

void Exposition::Sample(const std::string& name, const Labels& labels, std::uint64_t value) {
  Series(name, labels);
  text_ += std::to_string(value) + "\n";
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<std::uint64_t>[bounds_.size() + 1]) {
  for (std::size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // The first bucket whose upper bound holds v (le is "less or equal").
  const auto i =
      static_cast<std::size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

void Histogram::Render(Exposition& out, const std::string& name, const Labels& labels) const {
  Labels with_le = labels;
  with_le.emplace_back("le", "");
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    with_le.back().second = i < bounds_.size() ? FormatDouble(bounds_[i]) : "+Inf";
    out.Sample(name + "_bucket", with_le, cumulative);
  }
  out.Sample(name + "_sum", labels, sum());
  // The count is the +Inf bucket, so the two always agree in one render.
  out.Sample(name + "_count", labels, cumulative);
}

std::vector<double> DurationBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,    1,       2.5,    5,     10,     30,    60,   120,   300,  600};
}

}  // namespace ckpt::metrics
