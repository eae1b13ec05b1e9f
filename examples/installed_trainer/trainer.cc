// installed-trainer: the smallest trainer of an installed libckpt (see CMakeLists.txt beside
// it for how it is built). It keeps one buffer in shared memory, registers it, snapshots it
// as version 1, waits until that version is committed, overwrites the buffer, restores the
// newest committed version into it and checks every byte.
//
//   installed-trainer [--socket PATH] [--job NAME] [--mib N]
//
// --socket: the daemon's socket (default: $CKPTD_SOCKET, else /run/ckptd/ckptd.sock).
// Exit status: 0 restored and verified; 1 the restored bytes differ; 2 an error (ckpt::Error
// from the library, or bad arguments).
#include <ckpt/client.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

std::uint32_t Expected(std::size_t i) { return static_cast<std::uint32_t>(i * 2654435761u + 7); }

}  // namespace

int main(int argc, char** argv) {
  std::string socket, job = "installed-trainer";
  std::size_t mib = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--socket") {
      socket = argv[i + 1];
    } else if (flag == "--job") {
      job = argv[i + 1];
    } else if (flag == "--mib") {
      mib = std::strtoul(argv[i + 1], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: installed-trainer [--socket PATH] [--job NAME] [--mib N]\n");
      return 2;
    }
  }
  if (argc % 2 == 0 || mib == 0) {
    std::fprintf(stderr, "usage: installed-trainer [--socket PATH] [--job NAME] [--mib N]\n");
    return 2;
  }

  // A call to a daemon that is not there throws ckpt::Error, caught here across the library.
  try {
    ckpt::ClientOptions once;
    once.reconnect_budget = std::chrono::milliseconds(0);
    ckpt::Client::connect((socket.empty() ? std::string("/nonexistent") : socket) + ".absent", once).status();
    std::fprintf(stderr, "installed-trainer: a daemon answered on a socket that does not exist\n");
    return 2;
  } catch (const ckpt::Error& e) {
    std::printf("no daemon on a missing socket: ckpt::Error, code %d\n", e.code());
  }

  try {
    const std::size_t bytes = mib << 20;
    const std::size_t n = bytes / sizeof(std::uint32_t);
    auto region = ckpt::SharedRegion::create(bytes);
    auto* words = static_cast<std::uint32_t*>(region->data());
    for (std::size_t i = 0; i < n; ++i) words[i] = Expected(i);

    ckpt::Client client = ckpt::Client::connect(socket);
    client.register_items(job, /*rank=*/0, /*world_size=*/1,
                          {{"weights", ckpt::DType::kU32, {static_cast<std::int64_t>(n)}, region, 0}});
    client.snapshot(1, {{"step", "1"}});
    client.wait_snapshot(1);  // the buffer may change again from here on
    client.wait_durable(1, ckpt::Level::kCommitted);
    std::printf("version 1 %s on %s\n", ckpt::LevelName(ckpt::Level::kCommitted),
                client.socket_path().c_str());

    std::memset(words, 0, bytes);
    ckpt::RestoreResult restored = client.restore();
    std::string step;
    for (const ckpt::Blob& b : restored.blobs) {
      if (b.name == "step") step = b.data;
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (words[i] != Expected(i)) {
        std::fprintf(stderr, "installed-trainer: restored word %zu is %u, expected %u\n", i, words[i],
                     Expected(i));
        return 1;
      }
    }
    if (restored.version != 1 || step != "1") {
      std::fprintf(stderr, "installed-trainer: restored version %llu with step '%s', expected 1\n",
                   static_cast<unsigned long long>(restored.version), step.c_str());
      return 1;
    }
    std::printf("restored version 1 from the %s tier: %zu bytes verified\n", restored.tier.c_str(), bytes);
    client.unregister();
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "installed-trainer: %s (code %d)\n", e.what(), e.code());
    return 2;
  }
  return 0;
}
