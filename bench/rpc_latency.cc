// rpc_latency: the cost of the per-iteration calls themselves, without data movement
// worth the name. Registers N small tensors, then times `snapshot` and `wait_snapshot`
// calls (and an empty Status call, every tenth iteration) over many iterations.
//
// Each iteration, in order: [--floor] one empty unary call on a throwaway gRPC server of
// this build (see FloorServer); snapshot(v) with one small blob; wait_snapshot(v) right
// after it ("first wait": it includes copying the items out); [--settle, the default]
// wait_durable(v, committed), untimed, so that the version's flush and commit are not
// running during the next timed calls; wait_snapshot(v) again ("wait": for a version
// already captured, the call alone). The floor and every timed call thus meet a daemon in
// the same state, in the same run.
//
// Usage: ckpt-rpc-latency --socket PATH [--items N] [--iters I] [--floor] [--json] [--no-settle]
#include <ckpt/client.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/bench/floor.grpc.pb.h"
#include "signal_cleanup.h"

namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double P(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1))];
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "ckpt-rpc-latency: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(2);
}

// The message limits and idle timeout ckptd's server uses by default (daemon/main.cc:
// --max-blob-mib 256 + 16, --idle-timeout-s 600).
constexpr int kDaemonMessageLimit = (256 + 16) << 20;
constexpr int kDaemonIdleMs = 600 * 1000;

class FloorService final : public ckpt::bench::Floor::Service {
  grpc::Status Call(grpc::ServerContext*, const ckpt::bench::Empty*, ckpt::bench::Empty*) override {
    return grpc::Status::OK;
  }
};

// The floor server's process (ckpt-rpc-latency --serve-floor): built like ckptd's server
// (synchronous service, same limits, its own accept loop handing each connection to gRPC
// with AddInsecureChannelFromFd), it serves until the parent closes `lifeline_fd`.
int ServeFloor(const std::string& path, int ready_fd, int lifeline_fd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) Die("floor socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    errno = ENAMETOOLONG;
    Die("floor socket " + path);
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("bind " + path);
  if (::listen(listener, 128) != 0) Die("listen " + path);
  FloorService service;
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(kDaemonMessageLimit);
  builder.SetMaxSendMessageSize(kDaemonMessageLimit);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kDaemonIdleMs);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) Die("start the floor server");
  std::thread([lifeline_fd] {
    char c;
    while (::read(lifeline_fd, &c, 1) < 0 && errno == EINTR) {
    }
    std::_Exit(0);  // the parent is done: nothing of this process is worth a clean shutdown
  }).detach();
  if (::write(ready_fd, "r", 1) != 1) Die("floor ready");
  ::close(ready_fd);
  for (;;) {
    const int conn = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      Die("accept");
    }
    grpc::AddInsecureChannelFromFd(server.get(), conn);
  }
}

// The throwaway server of --floor, in a process of its own (as ckptd is): this program
// again, started before this process made any gRPC call, ended when this object goes.
class FloorServer {
 public:
  FloorServer() {
    char tmpl[] = "/tmp/ckpt-rpc-floor-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) Die("mkdtemp");
    dir_ = tmpl;
    bench::SignalCleanup::Install().Add(dir_);
    path_ = dir_ + "/floor.sock";
    int ready[2], lifeline[2];
    if (::pipe2(ready, O_CLOEXEC) != 0 || ::pipe(lifeline) != 0) Die("pipe");
    pid_ = ::fork();
    if (pid_ < 0) Die("fork");
    if (pid_ == 0) {
      bench::SignalCleanup::UnblockInChild();
      ::close(lifeline[1]);
      const int inherited = ::dup(ready[1]);  // without O_CLOEXEC
      const std::string rfd = std::to_string(inherited), lfd = std::to_string(lifeline[0]);
      ::execl("/proc/self/exe", "ckpt-rpc-latency", "--serve-floor", path_.c_str(), "--ready-fd", rfd.c_str(),
              "--lifeline-fd", lfd.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(ready[1]);
    ::close(lifeline[0]);
    lifeline_ = lifeline[1];
    ::fcntl(lifeline_, F_SETFD, FD_CLOEXEC);
    char c;
    ssize_t n;
    while ((n = ::read(ready[0], &c, 1)) < 0 && errno == EINTR) {
    }
    ::close(ready[0]);
    if (n != 1) {
      errno = ECHILD;
      Die("the floor server did not start");
    }
    // The client side as libckpt makes it (client/session.cc, NewStub).
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 30);
    args.SetMaxSendMessageSize(1 << 30);
    stub_ = ckpt::bench::Floor::NewStub(
        grpc::CreateCustomChannel("unix:" + path_, grpc::InsecureChannelCredentials(), args));
  }
  FloorServer(const FloorServer&) = delete;
  FloorServer& operator=(const FloorServer&) = delete;
  ~FloorServer() {
    stub_.reset();
    ::close(lifeline_);
    int st;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }

  // One empty call; throws on failure, as the client's calls do.
  void Call() {
    grpc::ClientContext ctx;
    ckpt::bench::Empty req, rep;
    grpc::Status s = stub_->Call(&ctx, req, &rep);
    if (!s.ok()) throw ckpt::Error(static_cast<int>(s.error_code()), "floor call: " + s.error_message());
  }

 private:
  std::string dir_, path_;
  pid_t pid_ = -1;
  int lifeline_ = -1;
  std::unique_ptr<ckpt::bench::Floor::Stub> stub_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string socket, serve_floor;
  std::size_t items = 1000, iters = 2000, warmup = 20;
  bool floor = false, json = false, no_settle = false;
  int ready_fd = -1, lifeline_fd = -1;
  CLI::App app{"Times ckptd's per-iteration calls"};
  app.add_option("--socket", socket, "ckptd socket");
  app.add_option("--items", items, "Tensors registered")->capture_default_str();
  app.add_option("--iters", iters, "Timed iterations")->capture_default_str();
  app.add_option("--warmup", warmup, "Iterations run first and not counted")->capture_default_str();
  app.add_flag("--floor", floor,
               "Also time an empty unary call on a throwaway gRPC server (same build, Unix socket)");
  app.add_flag("--json", json, "Print one JSON object instead of a line of text");
  app.add_flag("--no-settle", no_settle,
               "Do not wait for each version to commit before the next: the calls then overlap the daemon's "
               "flush of the previous version");
  app.add_option("--serve-floor", serve_floor)->group("");  // the floor server's own process
  app.add_option("--ready-fd", ready_fd)->group("");
  app.add_option("--lifeline-fd", lifeline_fd)->group("");
  CLI11_PARSE(app, argc, argv);
  if (!serve_floor.empty()) return ServeFloor(serve_floor, ready_fd, lifeline_fd);
  // Ended by a signal, it still removes its region and the floor server's directory (the
  // floor server ends with it: its lifeline closes).
  bench::SignalCleanup::Install();
  try {
    std::optional<FloorServer> floor_server;
    if (floor) floor_server.emplace();  // first: it forks
    auto region = ckpt::SharedRegion::create(std::max<std::size_t>(items, 1) * 64);
    std::vector<ckpt::TensorItem> list;
    for (std::size_t i = 0; i < items; ++i) {
      list.push_back(
          {"model.layers." + std::to_string(i) + ".weight", ckpt::DType::kF32, {16}, region, i * 64});
    }
    ckpt::Client client = ckpt::Client::connect(socket);
    client.register_items("rpc-latency-" + std::to_string(items) + "-" + std::to_string(::getpid()), 0, 1,
                          list);
    std::vector<double> floor_us, snap, first_wait, wait, status;
    for (std::size_t it = 1; it <= warmup + iters; ++it) {
      const bool counted = it > warmup;
      const auto t0 = Clock::now();
      if (floor_server) floor_server->Call();
      const auto t1 = Clock::now();
      client.snapshot(it, {{"step", std::to_string(it)}});
      const auto t2 = Clock::now();
      client.wait_snapshot(it);
      const auto t3 = Clock::now();
      if (!no_settle) client.wait_durable(it, ckpt::Level::kCommitted);
      const auto t4 = Clock::now();
      client.wait_snapshot(it);
      const auto t5 = Clock::now();
      if (it % 10 == 0) {
        (void)client.status();
        if (counted) status.push_back(Micros(Clock::now() - t5));
      }
      if (!counted) continue;
      if (floor_server) floor_us.push_back(Micros(t1 - t0));
      snap.push_back(Micros(t2 - t1));
      first_wait.push_back(Micros(t3 - t2));
      wait.push_back(Micros(t5 - t4));
    }
    if (json) {
      std::printf(
          "{\"items\": %zu, \"iters\": %zu, \"settle\": %s, \"floor_p50_us\": %.1f, \"floor_p99_us\": %.1f, "
          "\"snapshot_p50_us\": %.1f, \"snapshot_p99_us\": %.1f, \"wait_p50_us\": %.1f, \"wait_p99_us\": "
          "%.1f, "
          "\"first_wait_p50_us\": %.1f, \"first_wait_p99_us\": %.1f, \"status_p50_us\": %.1f}\n",
          items, iters, no_settle ? "false" : "true", P(floor_us, 50), P(floor_us, 99), P(snap, 50),
          P(snap, 99), P(wait, 50), P(wait, 99), P(first_wait, 50), P(first_wait, 99), P(status, 50));
    } else {
      std::printf(
          "%zu items, %zu iterations: snapshot call p50 %.0f us p99 %.0f us; wait_snapshot (captured) p50 "
          "%.0f "
          "us; first wait_snapshot p50 %.0f us; status call p50 %.0f us",
          items, iters, P(snap, 50), P(snap, 99), P(wait, 50), P(first_wait, 50), P(status, 50));
      if (floor_server) std::printf("; floor p50 %.0f us p99 %.0f us", P(floor_us, 50), P(floor_us, 99));
      std::printf("\n");
    }
  } catch (const ckpt::Error& e) {
    std::fprintf(stderr, "ckpt-rpc-latency: %s\n", e.what());
    return 2;
  }
  return 0;
}
