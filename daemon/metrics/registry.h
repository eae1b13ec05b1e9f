// Metric types and their rendering as Prometheus text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/).
//
//   Counter, Histogram          one time series each; updated with relaxed atomics, so a
//                               data-path thread pays one atomic add per update, no lock
//                               (gauges are read from their owners when rendering:
//                               Exposition::Header and Sample)
//   Family<T>                   the series of one metric name, one per label set; With()
//                               takes a lock to find or make a child: look children up
//                               once (at construction, per shard, per commit), never per
//                               chunk
//   Exposition                  the text being rendered: # HELP, # TYPE, samples, label
//                               values escaped
//
// Thread-safe: every update and Render may run concurrently. A series, once made, lives as
// long as its family.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/mutex.h"

namespace ckpt::metrics {

// Label name and value pairs, in the order they are rendered.
using Labels = std::vector<std::pair<std::string, std::string>>;

// Which series a reader may see (for instance: only the jobs of its uid); null shows all.
using LabelFilter = std::function<bool(const Labels&)>;

// The text being rendered.
class Exposition {
 public:
  // "# HELP" and "# TYPE" of a metric; `type` is counter, gauge or histogram.
  void Header(const std::string& name, const std::string& type, const std::string& help);
  void Sample(const std::string& name, const Labels& labels, double value);
  void Sample(const std::string& name, const Labels& labels, std::uint64_t value);
  const std::string& text() const { return text_; }
  std::string Take() { return std::move(text_); }

  // Label value escaping of the format: backslash, double quote and line feed.
  static std::string EscapeLabelValue(const std::string& value);

 private:
  void Series(const std::string& name, const Labels& labels);
  std::string text_;
};

class Counter {
 public:
  void Add(std::uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  std::uint64_t value() const { return value_.load(std::memory_order_relaxed); }
  void Render(Exposition& out, const std::string& name, const Labels& labels) const {
    out.Sample(name, labels, value());
  }
  static constexpr const char* kType = "counter";

 private:
  std::atomic<std::uint64_t> value_{0};
};

// Observations counted in buckets with fixed upper bounds (the +Inf bucket is implicit).
// Bucket counts are kept per bucket and summed into cumulative ones when rendered; a
// render that races an Observe may show the new count in one line and not yet in another,
// which Prometheus tolerates (each line is read on its own).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  void Render(Exposition& out, const std::string& name, const Labels& labels) const;
  static constexpr const char* kType = "histogram";

 private:
  const std::vector<double> bounds_;                       // ascending
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;  // bounds_.size() + 1 (+Inf)
  std::atomic<double> sum_{0};
};

// Buckets for durations in seconds, from 100 us to 10 min.
std::vector<double> DurationBuckets();

// Series with a common name, type and help, one per label set.
template <typename T>
class Family {
 public:
  // `make` builds a child (for histograms: with the family's buckets).
  Family(std::string name, std::string help, std::function<std::unique_ptr<T>()> make = nullptr)
      : name_(std::move(name)), help_(std::move(help)), make_(std::move(make)) {}

  // The series of `labels`, made on first use. The reference stays valid.
  T& With(const Labels& labels) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    auto& slot = children_[labels];
    if (!slot) {
      if constexpr (std::is_default_constructible_v<T>) {
        slot = make_ ? make_() : std::make_unique<T>();
      } else {
        slot = make_();
      }
    }
    return *slot;
  }

  void Render(Exposition& out, const LabelFilter& filter) const EXCLUDES(mu_) {
    out.Header(name_, T::kType, help_);
    MutexLock lock(mu_);
    for (const auto& [labels, child] : children_) {
      if (!filter || filter(labels)) child->Render(out, name_, labels);
    }
  }

 private:
  const std::string name_, help_;
  const std::function<std::unique_ptr<T>()> make_;
  mutable Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> children_ GUARDED_BY(mu_);
};

}  // namespace ckpt::metrics
