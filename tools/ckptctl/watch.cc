// status --watch: a frame every interval until a signal, the frame count, or the daemon
// going away.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>

#include "tools/ckptctl/commands.h"
#include "tools/ckptctl/common.h"
#include "tools/ckptctl/status_view.h"

namespace ckptctl {
namespace {

// SIGINT and SIGTERM stay blocked for the whole watch and are taken with sigtimedwait
// between frames: no handler runs inside gRPC, and gRPC's threads (started after the mask
// is set) inherit it, so the signal always reaches the wait.
class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~StopSignals() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Waits up to `seconds`; the signal that arrived meanwhile, or 0.
  int Wait(double seconds) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      const auto left = end - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) return 0;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      const int sig = sigtimedwait(&set_, nullptr, &ts);
      if (sig > 0) return sig;
      if (errno != EINTR && errno != EAGAIN) return 0;
    }
  }

 private:
  sigset_t set_;
  sigset_t old_;
};

}  // namespace

int Watch(const std::string& socket, double interval_s, std::uint64_t count, bool json) {
  StopSignals signals;
  auto stub = Connect(socket);
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  ckpt::v1::StatusReply previous;
  auto previous_at = std::chrono::steady_clock::now();
  bool have_previous = false;
  for (std::uint64_t frame = 0; count == 0 || frame < count; ++frame) {
    if (frame > 0) {
      if (int sig = signals.Wait(interval_s); sig != 0) {
        if (tty && !json) std::printf("\n");
        std::fflush(stdout);
        return kOk;  // an interrupted watch ends the way the user asked it to
      }
    }
    grpc::ClientContext ctx;
    SetDeadline(ctx, 10);
    ckpt::v1::StatusReply r;
    grpc::Status s = stub->Status(&ctx, ckpt::v1::StatusRequest(), &r);
    const auto at = std::chrono::steady_clock::now();
    if (!s.ok()) {
      std::fflush(stdout);
      if (have_previous) {
        std::cerr << "ckptctl: status --watch: the daemon on " << socket
                  << " went away: " << s.error_message() << "\n";
        return kFailure;
      }
      return Fail("status --watch", s, socket);
    }
    std::optional<Throughput> rate;
    if (have_previous)
      rate = ThroughputBetween(previous, r, std::chrono::duration<double>(at - previous_at).count());
    if (json) {
      nlohmann::ordered_json doc = StatusJson(r);
      doc["throughput"] = rate ? nlohmann::ordered_json{{"interval_s", rate->interval_s},
                                                        {"copy_bytes_per_s", rate->copy_bytes_per_s},
                                                        {"write_bytes_per_s", rate->write_bytes_per_s}}
                               : nlohmann::ordered_json(nullptr);
      // One object per line: a stream a script reads line by line.
      std::cout << doc.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
    } else {
      std::string text = RenderFrame(r, rate, socket);
      if (have_previous && previous.daemon_instance() != r.daemon_instance())
        text += "\n(the daemon restarted since the last frame)\n";
      if (tty) {
        std::fputs("\x1b[H\x1b[2J", stdout);  // home, clear: redrawn in place
      } else if (frame > 0) {
        std::fputs("\n", stdout);  // frames apart by one blank line
      }
      std::fputs(text.c_str(), stdout);
    }
    std::fflush(stdout);
    previous = std::move(r);
    previous_at = at;
    have_previous = true;
  }
  return kOk;
}

}  // namespace ckptctl
