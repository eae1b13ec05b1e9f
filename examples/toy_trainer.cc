// ckpt-toy-trainer: a stand-in for a training process, for demos, tests and benchmarks.
//
// It keeps N tensors (S MiB in all) in shared memory and loops: compute phase (C ms, the
// state is read-only, as in forward/backward), wait for the previous snapshot, update
// phase (every byte of every tensor changes, deterministically from the iteration), then
// snapshot every K iterations. With --resume it first restores the newest committed
// version (or --resume-version V) and checks every byte against what that iteration must
// have held. --frozen-tensors F keeps the first F tensors as iteration 0 set them, as frozen
// weights are in fine-tuning: the update phase does not touch them.
//
// --strategy picks how a checkpoint is taken, on the same state and schedule, so that
// bench/run.sh can put ckptd next to what trainers do without it:
//   lazy    ckptd (the default): snapshot(i) after the update, wait_snapshot(i) before the
//           next update;
//   sync    the trainer writes its own raw shard file with ordinary buffered writes and
//           fsyncs it before going on (what torch.save does);
//   staged  the trainer copies all state into its own preallocated host buffer, blocking,
//           and a background thread writes that buffer (buffered + fsync) while training
//           goes on; the next checkpoint first waits for the previous write (what DCP
//           async_save, TorchSnapshot and Orbax do);
//   none    no checkpoint: the baseline iteration time.
// The stall of a checkpoint is all the time the trainer is blocked for it: for lazy the
// snapshot call plus the wait before the next update, for sync the write and fsync, for
// staged the wait for the previous write plus the copy. sync and staged write raw files
// (the tensors back to back, no header, no checksums) to --dir, keeping the last two.
//
// --verify registers in verify mode (ckpt::RegisterOptions): the daemon checks each version,
// at the wait, against the checksums of its copy. --tear-at N is its test: the trainer breaks
// the contract once, changing a word of its state after version N was copied and before its
// wait, and the daemon must abort N (reported as a version error; with --keep-going training
// goes on and N never commits).
//
// A daemon restart under the trainer (lazy) is handled by libckpt: the call that finds the
// daemon gone reconnects within --reconnect-budget-s and registers again. With
// --keep-going, a version that fails (one lost to the restart, or any other error of a
// snapshot or a wait) is reported on stdout ("version error: ...", and for versions lost to
// a restart "lost versions: N M ...") and training goes on; every snapshot taken is
// reported as "snapshot taken: N". Without it, such an error ends the run (exit code 2).
#include <ckpt/client.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "trainer_stats.h"  // beside this file

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

using ckpt::examples::Ms;
using ckpt::examples::Percentile;

enum class Strategy { kNone, kSync, kStaged, kLazy };

const char* StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kNone:
      return "none";
    case Strategy::kSync:
      return "sync";
    case Strategy::kStaged:
      return "staged";
    case Strategy::kLazy:
      return "lazy";
  }
  return "?";
}

// One shard file written by the trainer itself (sync and staged): how long the writes and
// the fsync took, or why it failed.
struct FileWrite {
  std::string error;
  double ms = 0;
};

// Writes `bytes` from `data` to `path`.tmp with ordinary buffered writes in pieces of
// `piece` bytes (one per tensor, as a serializer would), fsyncs it and renames it to `path`.
FileWrite WriteShardFile(const std::string& path, const char* data, std::size_t bytes, std::size_t piece) {
  FileWrite r;
  auto t0 = Clock::now();
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    r.error = "open " + tmp + ": " + std::strerror(errno);
    return r;
  }
  std::size_t done = 0;
  while (done < bytes && r.error.empty()) {
    const std::size_t end = std::min(bytes, (done / piece + 1) * piece);
    ssize_t n = ::write(fd, data + done, end - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      r.error = "write " + tmp + ": " + std::strerror(n < 0 ? errno : ENOSPC);
    else
      done += static_cast<std::size_t>(n);
  }
  if (r.error.empty() && ::fsync(fd) != 0) r.error = "fsync " + tmp + ": " + std::strerror(errno);
  ::close(fd);
  if (r.error.empty() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    r.error = "rename " + tmp + ": " + std::strerror(errno);
  }
  r.ms = Ms(Clock::now() - t0);
  return r;
}

// The files of sync and staged: the newest two are kept, older ones are removed.
class ShardFiles {
 public:
  ShardFiles(std::string dir, std::string prefix) : dir_(std::move(dir)), prefix_(std::move(prefix)) {}
  std::string PathFor(std::uint64_t version) const {
    return dir_ + "/" + prefix_ + "-v" + std::to_string(version) + ".bin";
  }
  void Written(std::uint64_t version) {
    kept_.push_back(PathFor(version));
    while (kept_.size() > 2) {
      ::unlink(kept_.front().c_str());
      kept_.pop_front();
    }
  }

 private:
  std::string dir_, prefix_;
  std::deque<std::string> kept_;
};

// A JSON number, or null when the figure does not apply.
std::string JsonNumber(bool applies, double v) {
  if (!applies) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6f", v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, job = "toy", dir;
  std::uint32_t rank = 0, world = 1;
  std::uint64_t state_mib = 64, tensors = 8, iters = 10, every = 1, compute_ms = 100;
  std::uint64_t crash_at = 0;
  std::uint64_t frozen = 0, resume_version = 0;
  std::uint64_t tear_at = 0;
  bool verify = false;
  bool resume = false, quiet = false, spin = false, keep_going = false;
  double reconnect_budget_s = -1;
  Strategy strategy = Strategy::kLazy;
  std::string summary_path;
  const std::map<std::string, Strategy> strategies = {{"none", Strategy::kNone},
                                                      {"sync", Strategy::kSync},
                                                      {"staged", Strategy::kStaged},
                                                      {"lazy", Strategy::kLazy}};
  CLI::App app{"ckpt-toy-trainer: a simulated trainer that checkpoints through ckptd"};
  app.add_option("--socket", socket, "ckptd socket (default: the daemon's default)");
  app.add_option("--job", job, "Job id")->capture_default_str();
  app.add_option("--rank", rank, "Rank")->capture_default_str();
  app.add_option("--world-size", world, "World size")->capture_default_str();
  app.add_option("--state-mib", state_mib, "State size in MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--tensors", tensors, "Number of tensors")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--iters", iters, "Last iteration to run")->capture_default_str();
  app.add_option("--every", every, "Checkpoint every K iterations")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--compute-ms", compute_ms, "Compute phase per iteration in ms")->capture_default_str();
  app.add_flag("--spin", spin, "Busy-wait the compute phase instead of sleeping (keeps a core busy)");
  app.add_option("--strategy", strategy,
                 "How to checkpoint: lazy (ckptd), sync (own file, buffered writes + fsync), "
                 "staged (blocking copy to a host buffer, background write), none")
      ->transform(CLI::CheckedTransformer(strategies, CLI::ignore_case))
      ->default_str("lazy");
  app.add_option("--dir", dir, "Directory of the shard files of sync and staged");
  app.add_flag("--resume", resume, "Restore the newest committed version first and verify it (lazy only)");
  app.add_option("--resume-version", resume_version, "With --resume: restore this version, not the newest");
  app.add_option("--frozen-tensors", frozen,
                 "The first F tensors are frozen: set at iteration 0, never updated (fine-tuning's frozen weights)")
      ->capture_default_str();
  app.add_option("--crash-at", crash_at, "SIGKILL ourselves right after the snapshot of this iteration");
  app.add_flag("--verify", verify,
               "Register in verify mode: the daemon aborts a version whose memory changed before its wait");
  app.add_option("--tear-at", tear_at,
                 "Test mode (with --verify): change the state after this version's copy, before its wait");
  app.add_option("--summary", summary_path, "Write a JSON summary of the run to this file");
  app.add_flag("--quiet", quiet, "Print only the summary");
  app.add_flag("--keep-going", keep_going,
               "Report a failed version (snapshot or wait) and go on training instead of exiting");
  app.add_option("--reconnect-budget-s", reconnect_budget_s,
                 "How long a call waits for a daemon that went away (default: $CKPT_RECONNECT_BUDGET_S, "
                 "else 120 s; 0: no reconnection)")
      ->check(CLI::Range(0.0, 1e9));
  CLI11_PARSE(app, argc, argv);
  const bool lazy = strategy == Strategy::kLazy;
  const bool own_files = strategy == Strategy::kSync || strategy == Strategy::kStaged;
  if (own_files && dir.empty()) {
    std::fprintf(stderr, "ckpt-toy-trainer: --strategy %s needs --dir\n", StrategyName(strategy));
    return 2;
  }
  if (frozen > tensors) {
    std::fprintf(stderr, "ckpt-toy-trainer: --frozen-tensors %" PRIu64 " is more than --tensors %" PRIu64 "\n",
                 frozen, tensors);
    return 2;
  }
  if (resume_version != 0 && !resume) {
    std::fprintf(stderr, "ckpt-toy-trainer: --resume-version needs --resume\n");
    return 2;
  }
  if (resume && !lazy) {
    std::fprintf(stderr, "ckpt-toy-trainer: --resume restores through ckptd: only with --strategy lazy\n");
    return 2;
  }

  const std::size_t tensor_bytes = std::max<std::size_t>(8, (state_mib << 20) / tensors / 8 * 8);
  const std::size_t words = tensor_bytes / 8;
  const std::size_t state_bytes = tensor_bytes * tensors;
  try {
    auto region = ckpt::SharedRegion::create(state_bytes);
    auto* state = static_cast<std::uint64_t*>(region->data());
    std::optional<ckpt::Client> client;
    if (lazy) {
      std::vector<ckpt::TensorItem> items;
      for (std::size_t t = 0; t < tensors; ++t) {
        items.push_back({"layer" + std::to_string(t) + ".weight",
                         ckpt::DType::kF32,
                         {static_cast<std::int64_t>(tensor_bytes / 4)},
                         region,
                         t * tensor_bytes});
      }
      ckpt::ClientOptions options;
      if (reconnect_budget_s >= 0) {
        options.reconnect_budget =
            std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(reconnect_budget_s * 1000)));
      }
      client.emplace(ckpt::Client::connect(socket, options));
      ckpt::RegisterOptions register_options;
      register_options.verify = verify;
      auto reg = client->register_items(job, rank, world, items, register_options);
      std::printf("trainer rank %u/%u: %zu tensors, %.1f MiB in shared memory %s; daemon at %s\n", rank,
                  world, static_cast<std::size_t>(tensors), static_cast<double>(reg.tensor_bytes) / (1 << 20),
                  region->name().c_str(), client->socket_path().c_str());
    } else {
      std::printf("trainer rank %u/%u: %zu tensors, %.1f MiB in shared memory %s; strategy %s%s%s\n", rank,
                  world, static_cast<std::size_t>(tensors), static_cast<double>(state_bytes) / (1 << 20),
                  region->name().c_str(), StrategyName(strategy), own_files ? ", files in " : "",
                  own_files ? dir.c_str() : "");
    }

    std::uint64_t start = 0;
    double restore_ms = 0, restore_end_unix_ms = 0;
    std::uint64_t restored_version = 0;
    std::string restore_tier;
    if (resume) {
      auto t0 = Clock::now();
      auto r = resume_version != 0 ? client->restore(resume_version) : client->restore();
      restore_ms = Ms(Clock::now() - t0);
      restore_end_unix_ms =
          std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      restore_tier = r.tier;
      restored_version = r.version;
      std::string step;
      for (const auto& b : r.blobs)
        if (b.name == "step") step = b.data;
      if (step != std::to_string(r.version)) {
        std::fprintf(stderr, "RESUME FAILED: blob 'step' is '%s', expected '%" PRIu64 "'\n", step.c_str(),
                     r.version);
        return 3;
      }
      for (std::size_t t = 0; t < tensors; ++t) {
        std::size_t bad = FirstMismatch(state + t * words, words, rank, t, t < frozen ? 0 : r.version);
        if (bad != words) {
          std::fprintf(stderr,
                       "RESUME FAILED: tensor %zu differs at byte %zu from iteration %" PRIu64 "'s content\n",
                       t, bad * 8, r.version);
          return 3;
        }
      }
      std::printf("restored version %" PRIu64 " from %s (%.1f MiB) in %.1f ms; every byte verified\n",
                  r.version, r.tier.c_str(), static_cast<double>(r.tensor_bytes) / (1 << 20), restore_ms);
      start = r.version;
    } else {
      for (std::size_t t = 0; t < tensors; ++t) Fill(state + t * words, words, rank, t, 0);
    }

    // staged: the host buffer is allocated and touched once, as a saver preallocates (and
    // pins) its staging memory; the copy into it is then pure memcpy.
    std::unique_ptr<char[]> staging;
    if (strategy == Strategy::kStaged) {
      staging = std::make_unique_for_overwrite<char[]>(state_bytes);
      std::memset(staging.get(), 0, state_bytes);
    }
    ShardFiles files(dir, job + "-r" + std::to_string(rank));
    std::future<FileWrite> background;  // staged: the write of the previous checkpoint
    std::uint64_t background_version = 0;
    std::vector<double> flush_ms;
    auto finish_background = [&]() -> bool {
      if (!background.valid()) return true;
      FileWrite w = background.get();
      if (!w.error.empty()) {
        std::fprintf(stderr, "ckpt-toy-trainer: background write of version %" PRIu64 ": %s\n",
                     background_version, w.error.c_str());
        return false;
      }
      flush_ms.push_back(w.ms);
      files.Written(background_version);
      return true;
    };

    // --keep-going: a version's error is reported and the run goes on; else it ends the run.
    auto version_error = [&](const ckpt::Error& e) {
      if (!keep_going) throw;
      std::printf("version error (code %d): %s\n", e.code(), e.what());
      if (const auto* lost = dynamic_cast<const ckpt::DaemonRestartedError*>(&e)) {
        std::printf("lost versions:");
        for (std::uint64_t v : lost->versions()) std::printf(" %" PRIu64, v);
        std::printf("\n");
      }
      std::fflush(stdout);
    };
    std::vector<double> stalls, snapshot_calls, iter_ms;
    std::uint64_t pending = 0, last_snapshot = 0;
    std::size_t checkpoints = 0;
    double pending_call_ms = 0;
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
        try {
          if (pending == tear_at) {
            // Breaks the contract on purpose: once the version is copied, one word changes.
            (void)client->wait_snapshot(pending, std::chrono::milliseconds(0), /*seal=*/false);
            state[0] ^= 1;
            std::printf("iter %" PRIu64 ": changed the state of version %" PRIu64 " before its wait\n", it,
                        pending);
          }
          double wait = Ms(client->wait_snapshot(pending));
          stalls.push_back(pending_call_ms + wait);
          if (!quiet) {
            std::printf("iter %" PRIu64 ": wait_snapshot(%" PRIu64
                        ") stalled %.3f ms (snapshot call %.3f ms)\n",
                        it, pending, wait, pending_call_ms);
          }
        } catch (const ckpt::Error& e) {
          version_error(e);
        }
        pending = 0;
      }
      for (std::size_t t = frozen; t < tensors; ++t) Fill(state + t * words, words, rank, t, it);
      if (it % every == 0 && strategy != Strategy::kNone) {
        auto t0 = Clock::now();
        if (lazy) {
          try {
            client->snapshot(it, {{"step", std::to_string(it)}});
          } catch (const ckpt::Error& e) {
            version_error(e);
            iter_ms.push_back(Ms(Clock::now() - iter_start));
            continue;
          }
          pending_call_ms = Ms(Clock::now() - t0);
          snapshot_calls.push_back(pending_call_ms * 1000.0);
          pending = it;
          if (keep_going) {
            std::printf("snapshot taken: %" PRIu64 "\n", it);
            std::fflush(stdout);
          }
        } else if (strategy == Strategy::kSync) {
          FileWrite w = WriteShardFile(files.PathFor(it), reinterpret_cast<const char*>(state), state_bytes,
                                       tensor_bytes);
          if (!w.error.empty()) {
            std::fprintf(stderr, "ckpt-toy-trainer: %s\n", w.error.c_str());
            return 2;
          }
          flush_ms.push_back(w.ms);
          files.Written(it);
          stalls.push_back(Ms(Clock::now() - t0));
        } else {
          if (!finish_background()) return 2;
          std::memcpy(staging.get(), state, state_bytes);
          background_version = it;
          background = std::async(std::launch::async, WriteShardFile, files.PathFor(it), staging.get(),
                                  state_bytes, tensor_bytes);
          stalls.push_back(Ms(Clock::now() - t0));
        }
        if (!quiet && !lazy) std::printf("iter %" PRIu64 ": checkpoint stalled %.3f ms\n", it, stalls.back());
        last_snapshot = it;
        ++checkpoints;
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
      if (lazy) {
        try {
          client->wait_durable(last_snapshot);
        } catch (const ckpt::Error& e) {
          version_error(e);
        }
      }
      if (!finish_background()) return 2;
      durable_ms = Ms(Clock::now() - t0);
    }
    double iter_mean = 0;
    for (double v : iter_ms) iter_mean += v;
    if (!iter_ms.empty()) iter_mean /= static_cast<double>(iter_ms.size());
    const bool has_stalls = !stalls.empty(), has_flush = !flush_ms.empty();
    const double flush_p50 = Percentile(flush_ms, 50);
    std::printf(
        "summary: strategy %s, compute %s; %zu iterations in %.2f s; %zu checkpoints of %.1f MiB; "
        "stall p50 %.3f ms p99 %.3f ms; snapshot call p50 %.1f us; iteration p50 %.2f ms mean %.2f ms; "
        "last version %" PRIu64 " committed %.1f ms after the loop\n",
        StrategyName(strategy), spin ? "spin" : "wait", iter_ms.size(), run_s, checkpoints,
        static_cast<double>(state_bytes) / (1 << 20), Percentile(stalls, 50), Percentile(stalls, 99),
        Percentile(snapshot_calls, 50), Percentile(iter_ms, 50), iter_mean, last_snapshot, durable_ms);
    if (!summary_path.empty()) {
      if (FILE* f = std::fopen(summary_path.c_str(), "w")) {
        std::fprintf(
            f,
            "{\"strategy\": \"%s\", \"compute\": \"%s\", \"compute_ms\": %" PRIu64
            ", \"frozen_tensors\": %" PRIu64 ", \"rank\": %u, "
            "\"world_size\": %u, \"iters\": %zu, \"checkpoints\": %zu, \"state_bytes\": %zu, "
            "\"stall_ms_p50\": %s, \"stall_ms_p99\": %s, \"snapshot_call_us_p50\": %s, \"iter_ms_p50\": "
            "%.6f, "
            "\"iter_ms_mean\": %.6f, \"flush_ms_p50\": %s, \"flush_MBps_p50\": %s, \"restore_ms\": %s, "
            "\"run_s\": %.6f, \"last_version\": %" PRIu64
            ", \"final_durable_ms\": %.3f, "
            "\"restore_tier\": \"%s\", \"restore_end_unix_ms\": %.3f, \"restored_version\": %" PRIu64 "}\n",
            StrategyName(strategy), spin ? "spin" : "wait", compute_ms, frozen, rank, world, iter_ms.size(),
            checkpoints, state_bytes, JsonNumber(has_stalls, Percentile(stalls, 50)).c_str(),
            JsonNumber(has_stalls, Percentile(stalls, 99)).c_str(),
            JsonNumber(lazy && !snapshot_calls.empty(), Percentile(snapshot_calls, 50)).c_str(),
            Percentile(iter_ms, 50), iter_mean, JsonNumber(has_flush, flush_p50).c_str(),
            JsonNumber(has_flush && flush_p50 > 0,
                       static_cast<double>(state_bytes) / 1e6 / (flush_p50 / 1000))
                .c_str(),
            JsonNumber(resume, restore_ms).c_str(), run_s, last_snapshot, durable_ms, restore_tier.c_str(),
            restore_end_unix_ms, restored_version);
        std::fclose(f);
      }
    }
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "ckpt-toy-trainer: %s\n", e.what());
    return 2;
  }
  return 0;
}
