// ckpt-toy-trainer: a stand-in for a training process, for demos, tests and benchmarks.
//
// It keeps N tensors (S MiB in all) in shared memory and loops: compute phase (C ms, the
// state is read-only, as in forward/backward), wait for the previous snapshot, update
// phase (every byte of every tensor changes, deterministically from the iteration), then
// snapshot every K iterations. With --resume it first restores the newest committed
// version and checks every byte against what that iteration must have held.
#include <ckpt/client.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t Mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The content of tensor `t` of `rank` after the update of iteration `iter`.
void Fill(std::uint64_t* words, std::size_t n, std::uint32_t rank, std::size_t t, std::uint64_t iter) {
  const std::uint64_t base = Mix((std::uint64_t{rank} << 48) ^ (std::uint64_t{t} << 32) ^ iter);
  for (std::size_t i = 0; i < n; ++i) words[i] = base + i * 0xD6E8FEB86659FD93ull;
}

std::size_t FirstMismatch(const std::uint64_t* words, std::size_t n, std::uint32_t rank, std::size_t t,
                          std::uint64_t iter) {
  const std::uint64_t base = Mix((std::uint64_t{rank} << 48) ^ (std::uint64_t{t} << 32) ^ iter);
  for (std::size_t i = 0; i < n; ++i) {
    if (words[i] != base + i * 0xD6E8FEB86659FD93ull) return i;
  }
  return n;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

int main(int argc, char** argv) {
  std::string socket, job = "toy";
  std::uint32_t rank = 0, world = 1;
  std::uint64_t state_mib = 64, tensors = 8, iters = 10, every = 1, compute_ms = 100;
  std::uint64_t crash_at = 0;
  bool resume = false, quiet = false, spin = false;
  std::string summary_path;
  CLI::App app{"ckpt-toy-trainer: a simulated trainer that checkpoints through ckptd"};
  app.add_option("--socket", socket, "ckptd socket (default: the daemon's default)");
  app.add_option("--job", job, "Job id")->capture_default_str();
  app.add_option("--rank", rank, "Rank")->capture_default_str();
  app.add_option("--world-size", world, "World size")->capture_default_str();
  app.add_option("--state-mib", state_mib, "State size in MiB")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--tensors", tensors, "Number of tensors")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--iters", iters, "Last iteration to run")->capture_default_str();
  app.add_option("--every", every, "Checkpoint every K iterations")->capture_default_str()->check(CLI::Range(1, 1 << 30));
  app.add_option("--compute-ms", compute_ms, "Compute phase per iteration in ms")->capture_default_str();
  app.add_flag("--spin", spin, "Busy-wait the compute phase instead of sleeping (keeps a core busy)");
  app.add_flag("--resume", resume, "Restore the newest committed version first and verify it");
  app.add_option("--crash-at", crash_at, "SIGKILL ourselves right after the snapshot of this iteration");
  app.add_option("--summary", summary_path, "Write a JSON summary of the run to this file");
  app.add_flag("--quiet", quiet, "Print only the summary");
  CLI11_PARSE(app, argc, argv);

  const std::size_t tensor_bytes = std::max<std::size_t>(8, (state_mib << 20) / tensors / 8 * 8);
  const std::size_t words = tensor_bytes / 8;
  try {
    auto region = ckpt::SharedRegion::create(tensor_bytes * tensors);
    auto* state = static_cast<std::uint64_t*>(region->data());
    std::vector<ckpt::TensorItem> items;
    for (std::size_t t = 0; t < tensors; ++t) {
      items.push_back({"layer" + std::to_string(t) + ".weight", ckpt::DType::kF32,
                       {static_cast<std::int64_t>(tensor_bytes / 4)}, region, t * tensor_bytes});
    }
    ckpt::Client client = ckpt::Client::connect(socket);
    auto reg = client.register_items(job, rank, world, items);
    std::printf("trainer rank %u/%u: %zu tensors, %.1f MiB in shared memory %s; daemon at %s\n", rank, world,
                static_cast<std::size_t>(tensors), static_cast<double>(reg.tensor_bytes) / (1 << 20),
                region->name().c_str(), client.socket_path().c_str());

    std::uint64_t start = 0;
    if (resume) {
      auto t0 = Clock::now();
      auto r = client.restore();
      double ms = Ms(Clock::now() - t0);
      std::string step;
      for (const auto& b : r.blobs) if (b.name == "step") step = b.data;
      if (step != std::to_string(r.version)) {
        std::fprintf(stderr, "RESUME FAILED: blob 'step' is '%s', expected '%" PRIu64 "'\n", step.c_str(), r.version);
        return 3;
      }
      for (std::size_t t = 0; t < tensors; ++t) {
        std::size_t bad = FirstMismatch(state + t * words, words, rank, t, r.version);
        if (bad != words) {
          std::fprintf(stderr, "RESUME FAILED: tensor %zu differs at byte %zu from iteration %" PRIu64 "'s content\n",
                       t, bad * 8, r.version);
          return 3;
        }
      }
      std::printf("restored version %" PRIu64 " (%.1f MiB) in %.1f ms; every byte verified\n", r.version,
                  static_cast<double>(r.tensor_bytes) / (1 << 20), ms);
      start = r.version;
    } else {
      for (std::size_t t = 0; t < tensors; ++t) Fill(state + t * words, words, rank, t, 0);
    }

    std::vector<double> stalls, snapshot_calls, iter_ms;
    std::uint64_t pending = 0, last_snapshot = 0;
    auto run_start = Clock::now();
    for (std::uint64_t it = start + 1; it <= iters; ++it) {
      auto iter_start = Clock::now();
      // Compute phase: state is only read (forward and backward).
      if (spin) {
        auto until = Clock::now() + std::chrono::milliseconds(compute_ms);
        while (Clock::now() < until) {
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
      }
      // Update phase: first make sure the previous snapshot is out of our memory.
      if (pending != 0) {
        double stall = Ms(client.wait_snapshot(pending));
        stalls.push_back(stall);
        if (!quiet) std::printf("iter %" PRIu64 ": wait_snapshot(%" PRIu64 ") stalled %.3f ms\n", it, pending, stall);
        pending = 0;
      }
      for (std::size_t t = 0; t < tensors; ++t) Fill(state + t * words, words, rank, t, it);
      if (it % every == 0) {
        auto t0 = Clock::now();
        client.snapshot(it, {{"step", std::to_string(it)}});
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
    double run_s = Ms(Clock::now() - run_start) / 1000.0;
    double durable_ms = 0;
    if (last_snapshot != 0) {
      auto t0 = Clock::now();
      client.wait_durable(last_snapshot);
      durable_ms = Ms(Clock::now() - t0);
    }
    std::printf("summary: %zu iterations in %.2f s; %zu checkpoints of %.1f MiB; stall p50 %.3f ms p99 %.3f ms; "
                "snapshot call p50 %.1f us; iteration p50 %.2f ms; last version %" PRIu64 " committed %.1f ms after the loop\n",
                iter_ms.size(), run_s, snapshot_calls.size(), static_cast<double>(reg.tensor_bytes) / (1 << 20),
                Percentile(stalls, 50), Percentile(stalls, 99), Percentile(snapshot_calls, 50), Percentile(iter_ms, 50),
                last_snapshot, durable_ms);
    if (!summary_path.empty()) {
      if (FILE* f = std::fopen(summary_path.c_str(), "w")) {
        std::fprintf(f,
                     "{\"iters\": %zu, \"checkpoints\": %zu, \"state_bytes\": %" PRIu64 ", \"stall_ms_p50\": %.6f, "
                     "\"stall_ms_p99\": %.6f, \"snapshot_call_us_p50\": %.3f, \"iter_ms_p50\": %.6f, "
                     "\"run_s\": %.6f, \"last_version\": %" PRIu64 ", \"final_durable_ms\": %.3f}\n",
                     iter_ms.size(), snapshot_calls.size(), reg.tensor_bytes, Percentile(stalls, 50),
                     Percentile(stalls, 99), Percentile(snapshot_calls, 50), Percentile(iter_ms, 50), run_s,
                     last_snapshot, durable_ms);
        std::fclose(f);
      }
    }
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "ckpt-toy-trainer: %s\n", e.what());
    return 2;
  }
  return 0;
}
