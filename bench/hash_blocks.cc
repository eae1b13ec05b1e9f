// ckpt-hash-blocks: what per-block checksums (format 3, items with a global layout) cost the
// flush path. Hashes a shard of --mib MiB of --item-mib MiB tensors through ItemHasher the way
// the flush engine's writers do (chunks of --chunk-mib MiB, in file order, taken by --threads
// threads), once with whole-item checksums only and once with 1 MiB block checksums too, and
// prints GB/s (1e9 bytes/s, best of --repeats) of each and their ratio. --out FILE writes them
// as JSON (docs/results/hash_blocks.json).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "daemon/pipeline/item_hasher.h"
#include "format/global_layout.h"

using namespace ckpt;

namespace {

double HashOnce(const std::vector<char>& data, std::uint64_t item_bytes, std::uint64_t chunk_bytes,
                unsigned threads, bool blocks) {
  std::vector<ShardItem> items;
  for (std::uint64_t off = 0; off < data.size(); off += item_bytes) {
    ShardItem item;
    item.name = "t" + std::to_string(items.size());
    item.length = std::min<std::uint64_t>(item_bytes, data.size() - off);
    item.shape = {static_cast<std::int64_t>(item.length)};
    item.offset = off;
    if (blocks) {
      item.blocks.block_bytes = kBlockBytes;
      item.blocks.sums.resize(BlockCount(item.length, kBlockBytes));
    }
    items.push_back(std::move(item));
  }
  ItemHasher hasher(items);
  std::atomic<std::uint64_t> next{0};
  const auto start = std::chrono::steady_clock::now();
  auto worker = [&] {
    for (;;) {
      const std::uint64_t off = next.fetch_add(chunk_bytes);
      if (off >= data.size()) return;
      hasher.Hash(off, data.data() + off, std::min<std::uint64_t>(chunk_bytes, data.size() - off));
    }
  };
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(data.size()) / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"per-block checksums against whole-item checksums on the flush path"};
  std::uint64_t mib = 1024, item_mib = 256, chunk_mib = 64;
  unsigned threads = 1, repeats = 5;
  std::string out;
  app.add_option("--mib", mib, "shard data size");
  app.add_option("--item-mib", item_mib, "tensor size");
  app.add_option("--chunk-mib", chunk_mib, "pool chunk size (one writer's range)");
  app.add_option("--threads", threads, "writer threads hashing");
  app.add_option("--repeats", repeats, "runs; the best is reported");
  app.add_option("--out", out, "JSON file for the figures");
  CLI11_PARSE(app, argc, argv);
  std::vector<char> data(mib << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 2654435761u >> 13);
  double plain = 0, with_blocks = 0;
  for (unsigned r = 0; r < repeats; ++r) {
    plain = std::max(plain, HashOnce(data, item_mib << 20, chunk_mib << 20, threads, false));
    with_blocks = std::max(with_blocks, HashOnce(data, item_mib << 20, chunk_mib << 20, threads, true));
  }
  std::printf("shard %llu MiB, items %llu MiB, chunks %llu MiB, %u threads\n", (unsigned long long)mib,
              (unsigned long long)item_mib, (unsigned long long)chunk_mib, threads);
  std::printf("item checksums only:           %.2f GB/s\n", plain);
  std::printf("item + 1 MiB block checksums:  %.2f GB/s (%.2fx the time)\n", with_blocks,
              plain / with_blocks);
  if (!out.empty()) {
    std::ofstream f(out);
    f << "{\"bench\": \"hash_blocks\", \"shard_mib\": " << mib << ", \"item_mib\": " << item_mib
      << ", \"chunk_mib\": " << chunk_mib << ", \"threads\": " << threads << ", \"item_only_gbps\": " << plain
      << ", \"with_blocks_gbps\": " << with_blocks << ", \"time_ratio\": " << plain / with_blocks << "}\n";
  }
  return 0;
}
