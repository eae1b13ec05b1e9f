// ckpt-memcpy-bw: the memory ceilings the benchmarks put their figures next to. Prints GB/s
// (1e9 bytes) of the best of --repeats runs over --mib MiB.
//   --mode memcpy       single-thread memcpy between two preallocated, already touched host
//                       buffers: the ceiling of a blocking staging copy (bench/run.sh's
//                       memcpy limit).
//   --mode first-touch  a single-thread memset of a freshly created POSIX shm object through
//                       its mapping, as a fresh trainer fills its new shared memory: page
//                       allocation, zeroing and mapping included (bench/restore_mem.sh's
//                       bound for a restore into a fresh process).
//   --mode pwrite       the same object filled from a touched buffer with pwrite calls of
//                       16 MiB, as ckptd writes a restore into it (no mapping; pages are
//                       allocated, not zeroed, on first write).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace {

// A fresh shm object of `bytes`, unlinked at once (the descriptor keeps it).
int FreshShm(std::size_t bytes) {
  const std::string name = "/ckpt-memcpy-bw-" + std::to_string(::getpid());
  ::shm_unlink(name.c_str());
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  ::shm_unlink(name.c_str());
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 1024, repeats = 5;
  std::string mode = "memcpy";
  CLI::App app{"ckpt-memcpy-bw: memory ceilings (memcpy, first touch of fresh shared memory)"};
  app.add_option("--mib", mib, "Bytes per copy, in MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--repeats", repeats, "Copies; the best one counts")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--mode", mode, "memcpy, first-touch or pwrite")
      ->capture_default_str()
      ->check(CLI::IsMember({"memcpy", "first-touch", "pwrite"}));
  CLI11_PARSE(app, argc, argv);

  const std::size_t bytes = mib << 20;
  auto src = std::make_unique_for_overwrite<char[]>(bytes);
  std::memset(src.get(), 1, bytes);  // touch every page, so no fault of the source is timed
  std::unique_ptr<char[]> dst;
  if (mode == "memcpy") {
    dst = std::make_unique_for_overwrite<char[]>(bytes);
    std::memset(dst.get(), 2, bytes);
  }
  double best_s = 1e30;
  for (std::size_t i = 0; i < repeats; ++i) {
    int fd = -1;
    void* map = MAP_FAILED;
    if (mode != "memcpy") {
      fd = FreshShm(bytes);
      if (fd < 0) {
        std::perror("ckpt-memcpy-bw: shm object");
        return 1;
      }
      if (mode == "first-touch") {
        map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) {
          std::perror("ckpt-memcpy-bw: mmap");
          return 1;
        }
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    if (mode == "memcpy") {
      std::memcpy(dst.get(), src.get(), bytes);
    } else if (mode == "first-touch") {
      std::memset(map, 3, bytes);
    } else {
      constexpr std::size_t kPiece = 16 << 20;
      for (std::size_t off = 0; off < bytes; off += kPiece) {
        const std::size_t len = std::min(kPiece, bytes - off);
        if (::pwrite(fd, src.get() + off, len, static_cast<off_t>(off)) != static_cast<ssize_t>(len)) {
          std::perror("ckpt-memcpy-bw: pwrite");
          return 1;
        }
      }
    }
    best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (map != MAP_FAILED) ::munmap(map, bytes);
    if (fd >= 0) ::close(fd);
  }
  if (mode == "memcpy" && dst[bytes - 1] != 1) return 1;  // keeps the copy observable
  std::printf("%.2f\n", static_cast<double>(bytes) / 1e9 / best_s);
  return 0;
}
