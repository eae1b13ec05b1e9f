// ckpt-gpu-trainer: the GPU counterpart of ckpt-toy-trainer, and the trainer of the GPU
// proof (tests/gpu/run.sh).
//
// It keeps N tensors (S GiB in all) in cudaMalloc'd memory, registers them as GPU items
// (TensorItem::cuda_ptr) and loops like a trainer on one CUDA stream: compute phase (the
// stream is busy for C ms, then the host synchronises with it, as loss.item() would), wait
// for the previous snapshot (on the host with wait_snapshot, or stream-ordered with
// wait_snapshot_on_stream), update phase (every byte of every tensor changes,
// deterministically from the version), snapshot(v) on the stream. With --resume it first
// restores the newest committed version into fresh, poisoned allocations and checks every
// byte on the host. --measure-d2h measures plain cudaMemcpy between the device and pinned
// host memory: the ceiling the daemon's copies are compared with.
//
// No kernels, so no .cu file. The update is device-to-device copies out of a random
// pattern kept on the device: 4 MiB segment s of tensor t at version v is the pattern at an
// offset that depends on (seed, rank, t, s, v), so an update costs one pass over the state
// at device bandwidth, and a byte restored from the wrong version, tensor or place is
// caught. The compute phase is a stream-ordered host function that sleeps: it serialises
// with the update and with stream-ordered waits exactly as kernels would. Unlike kernels it
// leaves device memory idle, which flatters the daemon's copies little: they are bounded
// by PCIe, not by device memory bandwidth.
//
// Half of the tensors (the first ceil(N/2)) get a cudaMalloc each; the others are packed
// into one shared allocation, as a caching allocator would place them, so both an item at
// the base of its allocation and items at offsets inside one are exercised.
//
// Exit codes: 0 success, 2 error (CUDA or daemon), 3 restored state wrong, 4 no CUDA device.
#include <ckpt/client.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "trainer_stats.h"  // beside this file

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kSegmentBytes = std::size_t{4} << 20;
constexpr std::size_t kOffsetAlign = 256;  // keeps the D2D copies aligned
constexpr std::size_t kOffsetCount = (std::size_t{64} << 20) / kOffsetAlign;
constexpr std::size_t kPatternBytes = kOffsetCount * kOffsetAlign + kSegmentBytes;
constexpr std::uint64_t kVersionStride = 4099;             // odd: v -> offset is a bijection
constexpr std::size_t kStagingBytes = 64 * kSegmentBytes;  // host verification window

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
struct StreamDestroy {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct EventDestroy {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
using DeviceBuffer = std::unique_ptr<std::byte, DeviceFree>;
using PinnedBuffer = std::unique_ptr<std::byte, HostFree>;
using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDestroy>;
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDestroy>;

DeviceBuffer DeviceAlloc(std::size_t bytes) {
  void* p = nullptr;
  Check(cudaMalloc(&p, bytes), "cudaMalloc");
  return DeviceBuffer(static_cast<std::byte*>(p));
}

PinnedBuffer PinnedAlloc(std::size_t bytes) {
  void* p = nullptr;
  Check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc");
  return PinnedBuffer(static_cast<std::byte*>(p));
}

Stream MakeStream() {
  cudaStream_t s = nullptr;
  Check(cudaStreamCreate(&s), "cudaStreamCreate");
  return Stream(s);
}

Event MakeEvent() {
  cudaEvent_t e = nullptr;
  Check(cudaEventCreate(&e), "cudaEventCreate");
  return Event(e);
}

std::uint64_t Mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

using ckpt::examples::Ms;
using ckpt::examples::Percentile;

// The synthetic model state: where each tensor lives and what it holds at each version.
class GpuState {
 public:
  GpuState(std::uint64_t seed, std::uint32_t rank, std::size_t tensors, std::size_t tensor_bytes)
      : seed_(seed), rank_(rank), tensor_bytes_(tensor_bytes) {
    const std::size_t own = (tensors + 1) / 2;
    for (std::size_t t = 0; t < own; ++t) allocations_.push_back({DeviceAlloc(tensor_bytes), tensor_bytes});
    if (tensors > own)
      allocations_.push_back({DeviceAlloc(tensor_bytes * (tensors - own)), tensor_bytes * (tensors - own)});
    for (std::size_t t = 0; t < tensors; ++t) {
      ptrs_.push_back(t < own ? allocations_[t].first.get()
                              : allocations_.back().first.get() + (t - own) * tensor_bytes);
    }
    host_pattern_ = PinnedAlloc(kPatternBytes);
    auto* words = reinterpret_cast<std::uint64_t*>(host_pattern_.get());
    for (std::size_t i = 0; i < kPatternBytes / 8; ++i) words[i] = Mix(seed_ ^ (i * 0xD6E8FEB86659FD93ull));
    device_pattern_ = DeviceAlloc(kPatternBytes);
    Check(cudaMemcpy(device_pattern_.get(), host_pattern_.get(), kPatternBytes, cudaMemcpyHostToDevice),
          "cudaMemcpy (pattern)");
  }

  std::size_t tensors() const { return ptrs_.size(); }
  std::size_t tensor_bytes() const { return tensor_bytes_; }
  std::byte* tensor(std::size_t t) const { return ptrs_[t]; }

  // Queues on `stream` the update that gives every tensor its content at `version`.
  void Update(cudaStream_t stream, std::uint64_t version) const {
    for (std::size_t t = 0; t < ptrs_.size(); ++t) {
      for (std::size_t pos = 0; pos < tensor_bytes_; pos += kSegmentBytes) {
        Check(cudaMemcpyAsync(ptrs_[t] + pos, device_pattern_.get() + Offset(t, pos / kSegmentBytes, version),
                              std::min(kSegmentBytes, tensor_bytes_ - pos), cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync (update)");
      }
    }
  }

  // Fills every allocation with zero bytes (which the random pattern never holds over a
  // whole segment), so a restore that leaves anything out is caught.
  void Poison() const {
    for (const auto& [buffer, bytes] : allocations_) Check(cudaMemset(buffer.get(), 0, bytes), "cudaMemset");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  struct Mismatch {
    std::size_t tensor;
    std::size_t offset;
    unsigned expected;
    unsigned found;
  };

  // Copies every tensor to the host and compares every byte with its content at
  // `version`; returns the first difference.
  std::optional<Mismatch> Verify(std::uint64_t version) const {
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (!staging_) staging_ = PinnedAlloc(kStagingBytes);
    for (std::size_t t = 0; t < ptrs_.size(); ++t) {
      for (std::size_t base = 0; base < tensor_bytes_; base += kStagingBytes) {
        const std::size_t n = std::min(kStagingBytes, tensor_bytes_ - base);
        Check(cudaMemcpy(staging_.get(), ptrs_[t] + base, n, cudaMemcpyDeviceToHost), "cudaMemcpy (verify)");
        for (std::size_t pos = 0; pos < n; pos += kSegmentBytes) {
          const std::size_t len = std::min(kSegmentBytes, n - pos);
          const std::byte* want = host_pattern_.get() + Offset(t, (base + pos) / kSegmentBytes, version);
          const std::byte* got = staging_.get() + pos;
          if (std::memcmp(want, got, len) == 0) continue;
          std::size_t i = 0;
          while (want[i] == got[i]) ++i;
          return Mismatch{t, base + pos + i, static_cast<unsigned>(want[i]), static_cast<unsigned>(got[i])};
        }
      }
    }
    return std::nullopt;
  }

 private:
  // Offset in the pattern of segment `segment` of tensor `t` at `version`. For one segment,
  // versions fewer than kOffsetCount apart never share an offset.
  std::size_t Offset(std::size_t t, std::size_t segment, std::uint64_t version) const {
    const std::uint64_t base =
        Mix(seed_ ^ Mix((std::uint64_t{rank_} << 48) ^ (std::uint64_t{t} << 24) ^ segment));
    return static_cast<std::size_t>((base + version * kVersionStride) % kOffsetCount) * kOffsetAlign;
  }

  std::uint64_t seed_;
  std::uint32_t rank_;
  std::size_t tensor_bytes_;
  std::vector<std::pair<DeviceBuffer, std::size_t>> allocations_;
  std::vector<std::byte*> ptrs_;
  PinnedBuffer host_pattern_;
  DeviceBuffer device_pattern_;
  mutable PinnedBuffer staging_;
};

struct PinnedBandwidth {
  double d2h_gbps = 0;
  double h2d_gbps = 0;
};

// Plain synchronous cudaMemcpy of `bytes` between the device and pinned host memory:
// median of `reps` timed copies each way, after one untimed copy each way.
PinnedBandwidth MeasurePinnedCopies(std::size_t bytes, int reps) {
  DeviceBuffer dev = DeviceAlloc(bytes);
  PinnedBuffer host = PinnedAlloc(bytes);
  Check(cudaMemset(dev.get(), 1, bytes), "cudaMemset");
  std::memset(host.get(), 2, bytes);
  auto median_gbps = [&](cudaMemcpyKind kind) {
    void* dst =
        kind == cudaMemcpyDeviceToHost ? static_cast<void*>(host.get()) : static_cast<void*>(dev.get());
    const void* src =
        kind == cudaMemcpyDeviceToHost ? static_cast<void*>(dev.get()) : static_cast<void*>(host.get());
    Check(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy (measure)");
    std::vector<double> gbps;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      Check(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy (measure)");
      gbps.push_back(static_cast<double>(bytes) / 1e9 / (Ms(Clock::now() - t0) / 1000.0));
    }
    return Percentile(gbps, 50);
  };
  PinnedBandwidth bw;
  bw.d2h_gbps = median_gbps(cudaMemcpyDeviceToHost);
  bw.h2d_gbps = median_gbps(cudaMemcpyHostToDevice);
  return bw;
}

void CUDART_CB SleepOnStream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<const std::uint64_t*>(ms)));
}

// A flat JSON object written in insertion order; absent figures are null.
class JsonObject {
 public:
  void Number(const std::string& key, std::optional<double> v) {
    char buf[64] = "null";
    if (v && std::isfinite(*v)) std::snprintf(buf, sizeof buf, "%.6g", *v);
    Raw(key, buf);
  }
  void Integer(const std::string& key, std::uint64_t v) { Raw(key, std::to_string(v)); }
  void Text(const std::string& key, const std::string& v) {
    std::string s = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') s += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) s += c;
    }
    Raw(key, s + "\"");
  }
  void Bool(const std::string& key, bool v) { Raw(key, v ? "true" : "false"); }
  bool WriteTo(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return false;
    std::fprintf(f, "{%s}\n", body_.c_str());
    return std::fclose(f) == 0;
  }

 private:
  void Raw(const std::string& key, const std::string& value) {
    body_ += (body_.empty() ? "\n  \"" : ",\n  \"") + key + "\": " + value;
  }
  std::string body_;
};

void AddStats(JsonObject& json, const std::string& prefix, const std::vector<double>& v) {
  const bool any = !v.empty();
  json.Number(prefix + "_p50", any ? std::optional(Percentile(v, 50)) : std::nullopt);
  json.Number(prefix + "_p99", any ? std::optional(Percentile(v, 99)) : std::nullopt);
  json.Number(prefix + "_max", any ? std::optional(*std::max_element(v.begin(), v.end())) : std::nullopt);
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, job = "gpu", mode = "stream", summary_path;
  std::uint32_t rank = 0, world = 1;
  double state_gib = 4;
  std::uint64_t tensors = 16, iters = 20, every = 1, compute_ms = 200, crash_at = 0, seed = 1;
  int device = 0;
  bool resume = false, quiet = false, measure_d2h = false;
  CLI::App app{
      "ckpt-gpu-trainer: a simulated trainer with its state in GPU memory, checkpointing through ckptd"};
  app.add_option("--socket", socket, "ckptd socket (default: the daemon's default)");
  app.add_option("--job", job, "Job id")->capture_default_str();
  app.add_option("--rank", rank, "Rank")->capture_default_str();
  app.add_option("--world,--world-size", world, "World size")->capture_default_str();
  app.add_option("--device", device, "CUDA device ordinal")->capture_default_str();
  app.add_option("--state-gib", state_gib, "State size in GiB (fractions allowed)")
      ->capture_default_str()
      ->check(CLI::Range(1.0 / 1024, 1024.0));
  app.add_option("--tensors", tensors, "Number of tensors")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--iters", iters, "Last iteration to run (0 with --measure-d2h: measure only, no daemon)")
      ->capture_default_str();
  app.add_option("--every", every, "Checkpoint every K iterations")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--compute-ms", compute_ms, "Compute phase per iteration: the stream is busy this long")
      ->capture_default_str();
  app.add_option("--mode", mode,
                 "Wait for the previous snapshot on the host (wait_snapshot) or on the stream "
                 "(wait_snapshot_on_stream)")
      ->capture_default_str()
      ->check(CLI::IsMember({"host", "stream"}));
  app.add_option("--seed", seed, "Seed of the state's content")->capture_default_str();
  app.add_flag("--resume", resume,
               "Restore the newest committed version into fresh buffers first and verify every byte");
  app.add_option("--crash-at", crash_at, "SIGKILL ourselves right after the snapshot of this iteration");
  app.add_flag("--measure-d2h", measure_d2h,
               "First measure plain cudaMemcpy bandwidth of 1 GiB between the device and pinned host memory");
  app.add_option("--summary", summary_path, "Write a JSON summary of the run to this file");
  app.add_flag("--quiet", quiet, "Print only the summary");
  CLI11_PARSE(app, argc, argv);

  int device_count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&device_count); err != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "ckpt-gpu-trainer: no CUDA device (%s)\n",
                 err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
    return 4;
  }
  const bool stream_mode = mode == "stream";
  const std::size_t state_bytes =
      static_cast<std::size_t>(std::llround(state_gib * static_cast<double>(1ull << 30)));
  const std::size_t tensor_bytes =
      std::max<std::size_t>(kOffsetAlign, state_bytes / tensors / kOffsetAlign * kOffsetAlign);
  JsonObject json;
  try {
    Check(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    json.Text("device", prop.name);
    json.Text("mode", mode);

    std::optional<PinnedBandwidth> plain;
    if (measure_d2h) {
      plain = MeasurePinnedCopies(std::size_t{1} << 30, 5);
      std::printf(
          "plain cudaMemcpy of 1 GiB with pinned host memory on %s: D2H %.1f GB/s, H2D %.1f GB/s (median of "
          "5)\n",
          prop.name, plain->d2h_gbps, plain->h2d_gbps);
    }
    json.Number("d2h_pinned_GBps", plain ? std::optional(plain->d2h_gbps) : std::nullopt);
    json.Number("h2d_pinned_GBps", plain ? std::optional(plain->h2d_gbps) : std::nullopt);
    if (iters == 0 && !resume) {
      if (!summary_path.empty() && !json.WriteTo(summary_path)) {
        std::fprintf(stderr, "ckpt-gpu-trainer: cannot write %s\n", summary_path.c_str());
        return 2;
      }
      return 0;
    }

    // Declared before the client, so the client (and its registration) goes first.
    GpuState state(seed, rank, tensors, tensor_bytes);
    Stream stream = MakeStream();
    Event wait_begin = MakeEvent(), wait_end = MakeEvent();
    std::vector<ckpt::TensorItem> items;
    for (std::size_t t = 0; t < state.tensors(); ++t) {
      items.push_back({"layer" + std::to_string(t) + ".weight",
                       ckpt::DType::kBF16,
                       {static_cast<std::int64_t>(tensor_bytes / 2)},
                       nullptr,
                       0,
                       state.tensor(t)});
    }
    const std::uint64_t total_bytes = std::uint64_t{tensor_bytes} * state.tensors();

    std::uint64_t start = 0;
    std::optional<double> restore_ms;
    std::uint64_t restored_version = 0, verified_bytes = 0;
    if (resume) state.Poison();
    ckpt::Client client = ckpt::Client::connect(socket);
    auto reg = client.register_items(job, rank, world, items);
    std::printf("gpu trainer rank %u/%u (%s mode) on %s: %zu tensors, %.1f MiB of GPU memory; daemon at %s\n",
                rank, world, mode.c_str(), prop.name, state.tensors(),
                static_cast<double>(reg.tensor_bytes) / (1 << 20), client.socket_path().c_str());

    if (resume) {
      auto t0 = Clock::now();
      auto r = client.restore();
      restore_ms = Ms(Clock::now() - t0);
      std::string step;
      for (const auto& b : r.blobs) {
        if (b.name == "step") step = b.data;
      }
      if (step != std::to_string(r.version)) {
        std::fprintf(stderr, "RESUME FAILED: blob 'step' is '%s', expected '%" PRIu64 "'\n", step.c_str(),
                     r.version);
        return 3;
      }
      if (auto bad = state.Verify(r.version)) {
        std::fprintf(
            stderr,
            "RESUME FAILED: tensor %zu (layer%zu.weight) differs at byte offset %zu from version %" PRIu64
            "'s content: expected 0x%02x, found 0x%02x\n",
            bad->tensor, bad->tensor, bad->offset, r.version, bad->expected, bad->found);
        return 3;
      }
      restored_version = r.version;
      verified_bytes = total_bytes;
      std::printf("restored version %" PRIu64
                  " from %s (%.1f MiB) into fresh GPU buffers in %.1f ms = %.2f GB/s; "
                  "every byte verified\n",
                  r.version, r.tier.c_str(), static_cast<double>(r.tensor_bytes) / (1 << 20), *restore_ms,
                  static_cast<double>(r.tensor_bytes) / 1e9 / (*restore_ms / 1000.0));
      start = r.version;
    } else {
      // Version 0, checked once, so a failed resume can only be the checkpoint's fault.
      state.Update(stream.get(), 0);
      if (auto bad = state.Verify(0)) {
        std::fprintf(stderr,
                     "SELF-CHECK FAILED: tensor %zu differs at byte offset %zu after the initial fill\n",
                     bad->tensor, bad->offset);
        return 2;
      }
    }

    std::vector<double> stalls, gpu_waits, snapshot_calls, iter_ms;
    std::uint64_t pending = 0, last_snapshot = 0;
    bool gpu_wait_timed = false;
    auto collect_gpu_wait = [&](std::uint64_t it) {
      if (!gpu_wait_timed) return;
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, wait_begin.get(), wait_end.get()), "cudaEventElapsedTime");
      gpu_waits.push_back(ms);
      gpu_wait_timed = false;
      if (!quiet) std::printf("iter %" PRIu64 ": the stream waited %.3f ms for the copies\n", it, ms);
    };
    auto run_start = Clock::now();
    for (std::uint64_t it = start + 1; it <= iters; ++it) {
      auto iter_start = Clock::now();
      // Forward and backward: the state is only read. The host then waits for the stream,
      // as it would for the loss.
      if (compute_ms != 0)
        Check(cudaLaunchHostFunc(stream.get(), SleepOnStream, &compute_ms), "cudaLaunchHostFunc");
      Check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
      collect_gpu_wait(it - 1);
      // Update phase: the previous snapshot must be out of GPU memory first.
      if (pending != 0) {
        double stall = 0;
        if (stream_mode) {
          // The stream is idle here, so wait_begin completes at once and wait_end when the
          // stream has passed the daemon's event: their distance is the GPU-side stall.
          Check(cudaEventRecord(wait_begin.get(), stream.get()), "cudaEventRecord");
          stall = Ms(client.wait_snapshot_on_stream(pending, stream.get()));
          Check(cudaEventRecord(wait_end.get(), stream.get()), "cudaEventRecord");
          gpu_wait_timed = true;
        } else {
          stall = Ms(client.wait_snapshot(pending));
        }
        stalls.push_back(stall);
        if (!quiet) {
          std::printf("iter %" PRIu64 ": %s(%" PRIu64 ") blocked the host %.3f ms\n", it,
                      stream_mode ? "wait_snapshot_on_stream" : "wait_snapshot", pending, stall);
        }
        pending = 0;
      }
      state.Update(stream.get(), it);
      if (it % every == 0) {
        auto t0 = Clock::now();
        client.snapshot(it, {{"step", std::to_string(it)}}, stream.get());
        snapshot_calls.push_back(Ms(Clock::now() - t0) * 1000.0);
        pending = last_snapshot = it;
        if (it == crash_at) {
          std::printf("iter %" PRIu64 ": crashing on purpose (SIGKILL) after snapshot\n", it);
          std::fflush(stdout);
          ::kill(::getpid(), SIGKILL);
        }
      }
      iter_ms.push_back(Ms(Clock::now() - iter_start));
    }
    Check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
    collect_gpu_wait(iters);
    const double run_s = Ms(Clock::now() - run_start) / 1000.0;
    std::optional<double> durable_ms;
    if (last_snapshot != 0) {
      auto t0 = Clock::now();
      client.wait_durable(last_snapshot);
      durable_ms = Ms(Clock::now() - t0);
    }
    std::printf(
        "summary: %zu iterations in %.2f s; %zu checkpoints of %.1f MiB; host stall p50 %.3f ms p99 %.3f ms "
        "max %.3f ms",
        iter_ms.size(), run_s, snapshot_calls.size(), static_cast<double>(total_bytes) / (1 << 20),
        Percentile(stalls, 50), Percentile(stalls, 99),
        stalls.empty() ? 0.0 : *std::max_element(stalls.begin(), stalls.end()));
    if (stream_mode)
      std::printf("; stream stall p50 %.3f ms p99 %.3f ms", Percentile(gpu_waits, 50),
                  Percentile(gpu_waits, 99));
    std::printf("; snapshot call p50 %.1f us; iteration p50 %.2f ms; last version %" PRIu64
                " committed %.1f ms after the loop\n",
                Percentile(snapshot_calls, 50), Percentile(iter_ms, 50), last_snapshot,
                durable_ms.value_or(0));

    json.Integer("iters", iter_ms.size());
    json.Integer("checkpoints", snapshot_calls.size());
    json.Integer("tensors", state.tensors());
    json.Integer("state_bytes", total_bytes);
    json.Integer("compute_ms", compute_ms);
    AddStats(json, "stall_ms", stalls);
    AddStats(json, "gpu_wait_ms", gpu_waits);
    AddStats(json, "snapshot_call_us", snapshot_calls);
    AddStats(json, "iter_ms", iter_ms);
    json.Number("run_s", run_s);
    json.Integer("last_version", last_snapshot);
    json.Number("final_durable_ms", durable_ms);
    json.Bool("resumed", resume);
    json.Integer("restored_version", restored_version);
    json.Number("restore_ms", restore_ms);
    json.Number("restore_GBps",
                restore_ms ? std::optional(static_cast<double>(total_bytes) / 1e9 / (*restore_ms / 1000.0))
                           : std::nullopt);
    json.Integer("verified_bytes", verified_bytes);
    if (!summary_path.empty() && !json.WriteTo(summary_path)) {
      std::fprintf(stderr, "ckpt-gpu-trainer: cannot write %s\n", summary_path.c_str());
      return 2;
    }
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "ckpt-gpu-trainer: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-gpu-trainer: %s\n", e.what());
    return 2;
  }
  return 0;
}
