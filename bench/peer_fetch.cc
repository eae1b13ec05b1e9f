// ckpt-peer-fetch: what a peer restore's transfer costs, alone. Two Replicators in
// this process stand for two daemons on loopback TCP (their Peer servers, the shared secret,
// --replicas 1); one holds a shard of --mib MiB (16 tensors, a valid header and item
// checksums) in its memory tier, the other fetches it --iters times (Replicator::Fetch, the
// call a restore makes: GetShard, the fetched image in a buffer of its own) and compares it
// byte for byte. Prints each fetch's milliseconds and the median. No daemon start, no
// registration and no restore engine: bench/replication.sh measures the whole recovery.
#include <CLI/CLI.hpp>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "daemon/replication/replicator.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "signal_cleanup.h"

using namespace ckpt;

namespace {

// A port free now on 127.0.0.1 (the kernel picks it).
int FreePort() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = s >= 0 && ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (s >= 0) ::close(s);
  return ok ? ntohs(a.sin_port) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::SignalCleanup& cleanup = bench::SignalCleanup::Install();
  CLI::App app{"ckpt-peer-fetch: Replicator::Fetch of one shard over loopback TCP"};
  std::uint64_t mib = 1024;
  int iters = 5;
  app.add_option("--mib", mib, "shard size in MiB (16 tensors)")->check(CLI::Range(16, 1 << 16));
  app.add_option("--iters", iters, "fetches")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  char dir[] = "/tmp/ckpt-peer-fetch-XXXXXX";
  if (!::mkdtemp(dir)) {
    std::perror("mkdtemp");
    return 1;
  }
  cleanup.Add(dir);
  const std::string secret = std::string(dir) + "/secret";
  std::ofstream(secret) << "a secret for this benchmark only, 16+ bytes";
  ::chmod(secret.c_str(), 0600);
  const std::string a = "127.0.0.1:" + std::to_string(FreePort());
  const std::string b = "127.0.0.1:" + std::to_string(FreePort());
  const std::uint64_t bytes = mib << 20;
  MemoryTier holder(bytes + (64 << 20), 2), fetcher(64 << 20, 2);
  Config ca;
  ca.replicas = 1;
  ca.peers = {a, b};
  ca.peer_listen = a;
  ca.peer_secret = secret;
  Config cb = ca;
  cb.peer_listen = b;
  auto ra = Replicator::Create(ca, holder, {});
  auto rb = Replicator::Create(cb, fetcher, {});
  ::unlink(secret.c_str());
  ::rmdir(dir);
  if (!ra.ok() || !rb.ok()) {
    std::fprintf(stderr, "replicator: %s\n", (ra.ok() ? rb.status() : ra.status()).message().c_str());
    return 1;
  }

  const ShardMeta meta{"bench", 1, 0, 1, ""};
  std::vector<ShardItem> items(16);
  for (std::size_t i = 0; i < items.size(); ++i) {
    items[i].name = "t" + std::to_string(i);
    items[i].dtype = DType::kU8;
    items[i].length = bytes / items.size();
    items[i].shape = {static_cast<std::int64_t>(items[i].length)};
  }
  auto layout = ShardLayout::Plan(meta, items);
  if (!layout.ok()) {
    std::fprintf(stderr, "layout: %s\n", layout.status().message().c_str());
    return 1;
  }
  auto image = holder.Reserve(meta, layout->file_bytes());
  if (!image) {
    std::fprintf(stderr, "no room for the shard\n");
    return 1;
  }
  char* data = image->data() + layout->header_bytes();
  std::mt19937_64 rng(17);
  for (std::uint64_t i = 0; i + 8 <= layout->data_bytes(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(data + i, &v, 8);
  }
  for (ShardItem& item : layout->items()) item.checksum = Checksum::Of(data + item.offset, item.length);
  const std::string header = layout->RenderHeader();
  std::memcpy(image->data(), header.data(), header.size());
  holder.Complete(image);

  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    auto got = rb.value()->Fetch(a, meta.job, meta.version, meta.rank);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    if (!got.ok()) {
      std::fprintf(stderr, "fetch: %s\n", got.status().message().c_str());
      return 1;
    }
    if (got.value()->file_bytes != image->file_bytes ||
        std::memcmp(got.value()->data(), image->data(), image->file_bytes) != 0) {
      std::fprintf(stderr, "fetch %d: the image differs\n", i);
      return 1;
    }
    std::printf("fetch %d: %.0f ms\n", i, ms.back());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("median of %d fetches of %llu MiB: %.0f ms (%.2f GB/s)\n", iters, static_cast<unsigned long long>(mib),
              ms[ms.size() / 2], static_cast<double>(image->file_bytes) / 1e6 / ms[ms.size() / 2]);
  return 0;
}
