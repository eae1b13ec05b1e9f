// rpc_latency: the cost of the per-iteration calls themselves, without data movement
// worth the name. Registers N small tensors, then times `snapshot` and `wait_snapshot`
// calls (and, as a floor, an empty Status call) over many iterations.
//
// Usage: ckpt-rpc-latency --socket PATH [--items N] [--iters I]
#include <ckpt/client.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

double P(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket;
  std::size_t items = 1000, iters = 2000;
  CLI::App app{"Times ckptd's per-iteration calls"};
  app.add_option("--socket", socket, "ckptd socket");
  app.add_option("--items", items, "Tensors registered")->capture_default_str();
  app.add_option("--iters", iters, "Iterations")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  using Clock = std::chrono::steady_clock;
  try {
    auto region = ckpt::SharedRegion::create(items * 64);
    std::vector<ckpt::TensorItem> list;
    for (std::size_t i = 0; i < items; ++i) {
      list.push_back(
          {"model.layers." + std::to_string(i) + ".weight", ckpt::DType::kF32, {16}, region, i * 64});
    }
    ckpt::Client client = ckpt::Client::connect(socket);
    client.register_items("rpc-latency-" + std::to_string(items) + "-" + std::to_string(::getpid()), 0, 1,
                          list);
    std::vector<double> snap, wait, status;
    for (std::size_t it = 1; it <= iters; ++it) {
      auto t0 = Clock::now();
      client.snapshot(it, {{"step", std::to_string(it)}});
      auto t1 = Clock::now();
      client.wait_snapshot(it);
      auto t2 = Clock::now();
      if (it % 10 == 0) {
        auto t3 = Clock::now();
        (void)client.status();
        status.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t3).count());
      }
      snap.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      wait.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    }
    std::printf(
        "%zu items, %zu iterations: snapshot call p50 %.0f us p99 %.0f us; wait_snapshot p50 %.0f us; "
        "status call p50 %.0f us\n",
        items, iters, P(snap, 50), P(snap, 99), P(wait, 50), P(status, 50));
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "ckpt-rpc-latency: %s\n", e.what());
    return 2;
  }
  return 0;
}
