// ckpt-index-build: what writing index.json costs the committing daemon. Writes --ranks shard
// files of one version under --dir (headers as the daemon renders them, --items tensors per
// rank, each a row block of a global tensor of --mib-per-item MiB per rank, with its block
// checksums; the data sections sparse), then times VersionIndexWriter::Build (every header
// read and parsed, the index built) and Render, and prints the figures; --out FILE writes
// them as JSON (docs/results/index_build_1024.json and index_build_4096.json are two runs:
// --ranks 1024 and 4096). --dir is removed at the end, on an error and on SIGTERM, SIGINT
// or SIGHUP (bench/signal_cleanup.h).
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "signal_cleanup.h"
#include "daemon/catalog/version_index_writer.h"
#include "daemon/io/storage.h"
#include "format/shard_format.h"

using namespace ckpt;

namespace {

// Removes the directory when main returns, whichever way.
struct RemovedAtReturn {
  const std::string& dir;
  ~RemovedAtReturn() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::SignalCleanup& cleanup = bench::SignalCleanup::Install();
  CLI::App app{"cost of building a version's index.json from its shard headers"};
  std::uint32_t ranks = 1024, items = 100;
  std::uint64_t mib_per_item = 16;
  unsigned readers = 16;
  std::string dir = "/dev/shm/ckpt-index-build", out;
  app.add_option("--ranks", ranks, "world size");
  app.add_option("--items", items, "laid-out tensors per rank");
  app.add_option("--mib-per-item", mib_per_item, "MiB of each rank's piece of each tensor");
  app.add_option("--readers", readers, "headers read at once");
  app.add_option("--dir", dir, "checkpoint root to write the shards under (removed after)");
  app.add_option("--out", out, "JSON file for the figures");
  CLI11_PARSE(app, argc, argv);

  const std::string job = "idx";
  const std::uint64_t version = 1;
  cleanup.Add(dir);
  const RemovedAtReturn removed{dir};
  CheckpointTree tree(dir);
  std::filesystem::create_directories(tree.VersionDir(job, version));
  const std::int64_t cols = 1024;  // F32 columns: 4 KiB rows
  const std::int64_t rows = static_cast<std::int64_t>((mib_per_item << 20) / (4 * cols));
  std::uint64_t header_bytes = 0;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    std::vector<ShardItem> list;
    for (std::uint32_t i = 0; i < items; ++i) {
      ShardItem it;
      it.name = "layers." + std::to_string(i) + ".weight";
      it.dtype = DType::kF32;
      it.shape = {rows, cols};
      it.length = static_cast<std::uint64_t>(rows * cols * 4);
      GlobalLayout l;
      l.global_shape = {rows * ranks, cols};
      l.offsets = {rows * r, 0};
      if (!ResolveLayout(it.name, it.shape, &l).ok()) return 1;
      it.layout = l;
      it.blocks.block_bytes = kBlockBytes;
      list.push_back(std::move(it));
    }
    auto layout = ShardLayout::Plan(ShardMeta{job, version, r, ranks, "reg"}, std::move(list));
    if (!layout.ok()) {
      std::fprintf(stderr, "%s\n", layout.status().message().c_str());
      return 1;
    }
    const std::string header = layout->RenderHeader();
    header_bytes += header.size();
    const std::string path = tree.ShardPath(job, version, r);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::pwrite(fd, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size()) ||
        ::ftruncate(fd, static_cast<off_t>(layout->file_bytes())) != 0) {
      std::perror(path.c_str());
      return 1;
    }
    ::close(fd);
  }
  PosixStorage storage;
  VersionIndexWriter writer(storage, tree, readers);
  const auto start = std::chrono::steady_clock::now();
  auto index = writer.Build(job, version, ranks, std::vector<std::string>(ranks, "reg"));
  const auto built = std::chrono::steady_clock::now();
  if (!index.ok()) {
    std::fprintf(stderr, "%s\n", index.status().message().c_str());
    return 1;
  }
  const std::string text = index->Render();
  const auto rendered = std::chrono::steady_clock::now();
  std::filesystem::remove_all(dir);
  const double build_s = std::chrono::duration<double>(built - start).count();
  const double render_s = std::chrono::duration<double>(rendered - built).count();
  std::printf("%u ranks x %u tensors (%llu MiB each per rank): headers %.1f MB in all, read and indexed in %.3f s "
              "(%u at once), index.json %.1f MB rendered in %.3f s\n",
              ranks, items, static_cast<unsigned long long>(mib_per_item), header_bytes / 1e6, build_s, readers,
              text.size() / 1e6, render_s);
  if (!out.empty()) {
    std::ofstream f(out);
    f << "{\"bench\": \"index_build\", \"ranks\": " << ranks << ", \"items\": " << items
      << ", \"mib_per_item\": " << mib_per_item << ", \"readers\": " << readers
      << ", \"header_bytes\": " << header_bytes << ", \"build_s\": " << build_s
      << ", \"index_bytes\": " << text.size() << ", \"render_s\": " << render_s << "}\n";
  }
  return 0;
}
