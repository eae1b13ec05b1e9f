// ckpt-reshard-restore: the trainer side of bench/reshard_restore.sh. One process plays every
// rank of a job (one Client and one shm region per rank, the ranks on their own threads).
//
//   save    --ranks 4 --mib 1024 : 4 global F32 tensors of mib/4 MiB each ([rows, 4096]):
//           two split by rows and two by columns among the ranks; version 1, committed.
//   restore --ranks N [--as-saved]: N ranks, each its rows of every tensor (row split; with
//           --as-saved the boxes of the save, for the same-size restore), restore
//           the newest version at once; prints one JSON line: the wall time from the first
//           restore call to the last return, the tier, whether it was resharded, and whether
//           every byte matched the global tensors.
//
// Usage: ckpt-reshard-restore --socket S --job J (save|restore) --ranks N [--mib M]
#include <ckpt/client.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "signal_cleanup.h"

using namespace ckpt;

namespace {

constexpr std::int64_t kCols = 4096;
constexpr int kTensors = 4;

// The value of element (row, col) of tensor t: cheap to compute, different everywhere.
float Value(int t, std::int64_t row, std::int64_t col) {
  return static_cast<float>((row * 7919 + col * 31 + t * 104729) % 1000003);
}

struct Box {
  std::int64_t r0, rows, c0, cols;
};

// Rank r's box of tensor t when saved (t even: rows; t odd: columns) or restored (rows).
Box BoxOf(int t, std::int64_t total_rows, std::uint32_t r, std::uint32_t n, bool saving) {
  if (saving && t % 2 == 1) {
    const std::int64_t c0 = kCols * r / n, c1 = kCols * (r + 1) / n;
    return {0, total_rows, c0, c1 - c0};
  }
  const std::int64_t r0 = total_rows * r / n, r1 = total_rows * (r + 1) / n;
  return {r0, r1 - r0, 0, kCols};
}

struct Rank {
  std::shared_ptr<SharedRegion> region;
  std::vector<TensorItem> items;
  std::vector<Box> boxes;
  std::unique_ptr<Client> client;
};

std::unique_ptr<Rank> MakeRank(const std::string& socket, const std::string& job, std::int64_t total_rows,
                               std::uint32_t r, std::uint32_t n, bool saving) {
  auto k = std::make_unique<Rank>();
  std::size_t bytes = 0;
  for (int t = 0; t < kTensors; ++t) {
    const Box b = BoxOf(t, total_rows, r, n, saving);
    TensorItem it;
    it.name = "t" + std::to_string(t);
    it.dtype = DType::kF32;
    it.shape = {b.rows, b.cols};
    it.offset = bytes;
    Layout l;
    l.global_shape = {total_rows, kCols};
    l.offsets = {b.r0, b.c0};
    it.layout = l;
    bytes += static_cast<std::size_t>(b.rows * b.cols) * 4;
    k->items.push_back(it);
    k->boxes.push_back(b);
  }
  k->region = SharedRegion::create(bytes);
  for (auto& it : k->items) it.region = k->region;
  k->client = std::make_unique<Client>(Client::connect(socket));
  k->client->register_items(job, r, n, k->items);
  return k;
}

void Fill(Rank& k) {
  for (std::size_t t = 0; t < k.items.size(); ++t) {
    float* p = reinterpret_cast<float*>(static_cast<char*>(k.region->data()) + k.items[t].offset);
    const Box& b = k.boxes[t];
    for (std::int64_t i = 0; i < b.rows; ++i) {
      for (std::int64_t j = 0; j < b.cols; ++j) *p++ = Value(static_cast<int>(t), b.r0 + i, b.c0 + j);
    }
  }
}

bool Check(const Rank& k) {
  for (std::size_t t = 0; t < k.items.size(); ++t) {
    const float* p =
        reinterpret_cast<const float*>(static_cast<const char*>(k.region->data()) + k.items[t].offset);
    const Box& b = k.boxes[t];
    for (std::int64_t i = 0; i < b.rows; ++i) {
      for (std::int64_t j = 0; j < b.cols; ++j) {
        if (*p++ != Value(static_cast<int>(t), b.r0 + i, b.c0 + j)) return false;
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Ended by a signal, it still removes the ranks' shm regions (a normal exit: libckpt does).
  bench::SignalCleanup::Install();
  CLI::App app{"ckpt-reshard-restore: the trainer side of bench/reshard_restore.sh"};
  std::string socket, job = "reshard", mode;
  std::uint32_t ranks = 4;
  std::uint64_t mib = 1024;
  app.add_option("--socket", socket)->required();
  app.add_option("--job", job);
  app.add_option("--ranks", ranks)->check(CLI::Range(1u, 64u));
  app.add_option("--mib", mib, "global state in MiB (a multiple of 64)");
  bool as_saved = false;
  app.add_flag("--as-saved", as_saved, "restore with the boxes of the save (same world size: the fast path)");
  app.add_option("mode", mode)->required()->check(CLI::IsMember({"save", "restore"}));
  CLI11_PARSE(app, argc, argv);
  const std::int64_t total_rows = static_cast<std::int64_t>(mib << 20) / kTensors / (kCols * 4);
  try {
    std::vector<std::unique_ptr<Rank>> rs(ranks);
    {
      std::vector<std::thread> th;
      for (std::uint32_t r = 0; r < ranks; ++r) {
        th.emplace_back(
            [&, r] { rs[r] = MakeRank(socket, job, total_rows, r, ranks, mode == "save" || as_saved); });
      }
      for (auto& t : th) t.join();
    }
    if (mode == "save") {
      for (auto& k : rs) Fill(*k);
      for (auto& k : rs) k->client->snapshot(1);
      for (auto& k : rs) k->client->wait_durable(1, Level::kCommitted);
      std::printf("{\"saved\": 1}\n");
    } else {
      std::vector<RestoreResult> res(ranks);
      std::vector<std::string> errors(ranks);
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> th;
      for (std::uint32_t r = 0; r < ranks; ++r) {
        th.emplace_back([&, r] {
          try {
            res[r] = rs[r]->client->restore();
          } catch (const std::exception& e) {
            errors[r] = e.what();
          }
        });
      }
      for (auto& t : th) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (auto& e : errors) {
        if (!e.empty()) {
          std::fprintf(stderr, "restore failed: %s\n", e.c_str());
          return 1;
        }
      }
      bool ok = true;
      for (auto& k : rs) ok = ok && Check(*k);
      std::printf(
          "{\"seconds\": %.4f, \"tier\": \"%s\", \"resharded\": %s, \"world_size\": %u, \"bytes_ok\": %s}\n",
          s, res[0].tier.c_str(), res[0].resharded ? "true" : "false", res[0].world_size,
          ok ? "true" : "false");
      if (!ok) return 1;
    }
    for (auto& k : rs) k->client->unregister();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
