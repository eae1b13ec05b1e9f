// ckpt-memcpy-bw: single-thread memcpy bandwidth between two preallocated, already touched
// host buffers, the ceiling of a blocking staging copy (what bench/run.sh calls the memcpy
// limit). Prints the best of --repeats copies of --mib MiB, in GB/s (1e9 bytes).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

int main(int argc, char** argv) {
  std::size_t mib = 1024, repeats = 5;
  CLI::App app{"ckpt-memcpy-bw: single-thread memcpy bandwidth"};
  app.add_option("--mib", mib, "Bytes per copy, in MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--repeats", repeats, "Copies; the best one counts")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  const std::size_t bytes = mib << 20;
  auto src = std::make_unique_for_overwrite<char[]>(bytes);
  auto dst = std::make_unique_for_overwrite<char[]>(bytes);
  std::memset(src.get(), 1, bytes);  // touch every page of both, so no fault is timed
  std::memset(dst.get(), 2, bytes);
  double best_s = 1e30;
  for (std::size_t i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.get(), src.get(), bytes);
    best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (dst[bytes - 1] != 1) return 1;  // keeps the copy observable
  std::printf("%.2f\n", static_cast<double>(bytes) / 1e9 / best_s);
  return 0;
}
