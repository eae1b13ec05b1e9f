// ckptd: the node-local checkpoint daemon.
//
// Sets up the socket (its directory 0700, the socket itself --socket-mode), accepts
// connections itself (rpc/acceptor.h: SO_PEERCRED, the connection limits, no spinning when
// descriptors run out), and hands them to a gRPC server that runs CheckpointService
// (daemon/rpc/) over the Daemon's parts (daemon/daemon.h). Picks the implementations: POSIX
// storage, the shm importer, the CUDA backend where built. SIGTERM/SIGINT stop it
// gracefully: no new calls, waiting calls end at once, running ones get up to
// kShutdownGrace, in-flight shards finish. Readiness is announced on --ready-fd and to
// systemd (NOTIFY_SOCKET).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/io/fault_storage.h"
#include "daemon/io/shm_importer.h"
#include "daemon/metrics/metrics_export.h"
#include "daemon/rpc/acceptor.h"
#include "daemon/rpc/peer_registry.h"
#include "daemon/rpc/service.h"
#include "format/paths.h"
#ifdef CKPT_HAVE_CUDA
#include "cuda/cuda_backend.h"
#include "cuda/cuda_error.h"
#include "cuda/test_device_backend.h"
#endif

namespace ckpt {
namespace {

int g_signal_pipe[2] = {-1, -1};
// Set when a sticky CUDA error made the process's context unusable: the daemon stops and
// exits with kStickyErrorExit, for systemd (Restart=on-failure) to start a fresh one.
std::atomic<bool> g_sticky_error{false};
constexpr int kStickyErrorExit = 70;  // EX_SOFTWARE

// How long running calls may take to finish once SIGTERM came (waiting ones end at once).
constexpr std::chrono::seconds kShutdownGrace{5};
// Then the replies of the calls that just ended are still being sent: the server waits this
// long for them before it cancels what is left and closes the idle connections (which would
// otherwise hold it up until the client hangs up).
constexpr std::chrono::milliseconds kReplyFlush{200};

void OnSignal(int) {
  char c = 1;
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

// Creates the socket's directory if missing (0700) and refuses one others can write.
bool PrepareSocketDir(const std::string& socket_path) {
  std::string dir = socket_path.substr(0, socket_path.find_last_of('/'));
  if (dir.empty()) return true;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (::mkdir(dir.c_str(), 0700) != 0) {
      spdlog::critical("cannot create socket directory {}: {}", dir, std::strerror(errno));
      return false;
    }
    return true;
  }
  if (!S_ISDIR(st.st_mode)) {
    spdlog::critical("socket directory {} is not a directory", dir);
    return false;
  }
  if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
    spdlog::critical("socket directory {} is writable by everyone; refusing to serve there", dir);
    return false;
  }
  return true;
}

UniqueFd Listen(const Config& config) {
  sockaddr_un addr{};
  if (config.socket_path.size() >= sizeof addr.sun_path) {
    spdlog::critical("socket path {} is too long (max {} bytes)", config.socket_path,
                     sizeof addr.sun_path - 1);
    return {};
  }
  if (!PrepareSocketDir(config.socket_path)) return {};
  // Non-blocking: the accept loop takes what is pending and returns to poll().
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return {};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, config.socket_path.c_str());
  // A socket file left by a daemon that died is replaced; a live daemon is not.
  if (::access(config.socket_path.c_str(), F_OK) == 0) {
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      spdlog::critical("another daemon is serving {}", config.socket_path);
      return {};
    }
    ::unlink(config.socket_path.c_str());
  }
  mode_t old = ::umask(0777 & ~config.socket_mode);
  int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old);
  if (rc != 0) {
    spdlog::critical("cannot bind {}: {}", config.socket_path, std::strerror(errno));
    return {};
  }
  ::chmod(config.socket_path.c_str(), config.socket_mode);
  if (::listen(fd.get(), 128) != 0) {
    spdlog::critical("cannot listen on {}: {}", config.socket_path, std::strerror(errno));
    return {};
  }
  return fd;
}

// Raises the soft open-file limit to the hard one (the default soft limit, 1024, is far too
// few for a daemon holding a descriptor per connection, region and shard in flight).
// Returns the soft limit in force.
rlim_t RaiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 1024;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    // An unlimited hard limit cannot be the soft one (the kernel caps it at fs.nr_open).
    if (raised.rlim_cur == RLIM_INFINITY) raised.rlim_cur = 1 << 20;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      lim = raised;
    } else {
      spdlog::warn("cannot raise the open-file limit from {} to {}: {}", lim.rlim_cur, raised.rlim_cur,
                   std::strerror(errno));
    }
  }
  return lim.rlim_cur;
}

// The connection limits in force: --max-connections 0 is half the open-file limit (the rest
// is for regions and shards), at most 16384.
PeerRegistry::Limits ConnectionLimits(const Config& config, rlim_t open_files) {
  PeerRegistry::Limits limits;
  limits.total = config.max_connections != 0
                     ? config.max_connections
                     : static_cast<std::uint32_t>(std::clamp<rlim_t>(open_files / 2, 16, 16384));
  limits.per_uid = config.max_connections_per_uid;
  if (limits.total > open_files / 2) {
    spdlog::warn(
        "--max-connections {} is more than half the open-file limit ({}): idle connections may use up "
        "the descriptors the daemon needs for regions and shards",
        limits.total, open_files);
  }
  return limits;
}

void NotifySystemd(const char* state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || (path[0] != '/' && path[0] != '@')) return;
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
  if (path[0] == '@') addr.sun_path[0] = '\0';
  ::sendto(fd.get(), state, std::strlen(state), 0, reinterpret_cast<sockaddr*>(&addr),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + std::strlen(path)));
}

int Run(const Config& config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e ckptd[%P] %l: %v");
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) return 1;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  // Temporary files on the shared persistent tier carry this daemon's name.
  SetTmpOwner(config.node_id);
  const rlim_t open_files = RaiseOpenFileLimit();
  const PeerRegistry::Limits connection_limits = ConnectionLimits(config, open_files);
  PeerRegistry peers(connection_limits);
  std::shared_ptr<DeviceBackend> backend;
  std::string no_backend_reason = "ckptd was built without CUDA";
#ifdef CKPT_HAVE_CUDA
  cuda::SetStickyErrorHandler([](const std::string& text) {
    if (g_sticky_error.exchange(true)) return;
    spdlog::critical(
        "the CUDA context of ckptd is unusable ({}): every further GPU copy would fail; stopping, to exit "
        "with status {} for a restart",
        text, kStickyErrorExit);
    char c = 2;
    [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
  });
  auto test_backend = cuda::MakeTestDeviceBackend();  // tests only (cuda/test_device_backend.h)
  if (!test_backend.ok()) {
    spdlog::critical("cannot start: {}", test_backend.status().message());
    return 1;
  }
  if (test_backend.value()) {
    backend = std::move(test_backend).value();
  } else if (auto made = cuda::MakeCudaBackend(); made.ok()) {
    backend = std::move(made).value();
  } else {
    no_backend_reason = made.status().message();
  }
#endif
  auto storage = WrapWithTestFault(std::make_shared<PosixStorage>());  // tests only (fault_storage.h)
  if (!storage.ok()) {
    spdlog::critical("cannot start: {}", storage.status().message());
    return 1;
  }
  auto daemon = Daemon::Create(config, std::move(storage).value(), std::make_unique<ShmImporter>(),
                               std::move(backend), no_backend_reason);
  if (!daemon.ok()) {
    spdlog::critical("cannot start: {}", daemon.status().message());
    return 1;
  }
  // Before the socket exists: a port in use stops the start with nothing left behind.
  auto metrics = metrics::MetricsExport::Start(config, *daemon.value());
  if (!metrics.ok()) {
    spdlog::critical("cannot start: {}", metrics.status().message());
    return 1;
  }
  CheckpointService service(*daemon.value(), &peers);
  UniqueFd listener = Listen(config);
  if (!listener.valid()) return 1;

  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<std::uint64_t>(config.max_blob_mib + 16, 2000) << 20));
  builder.SetMaxSendMessageSize(
      static_cast<int>(std::min<std::uint64_t>(config.max_blob_mib + 16, 2000) << 20));
  if (config.idle_timeout_s > 0) {
    // Applies to the connections handed over from our own accept loop too: gRPC sends
    // GOAWAY and closes a connection that had no call for this long.
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_IDLE_MS,
        static_cast<int>(std::min<std::uint64_t>(config.idle_timeout_s, 1u << 20) * 1000));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    spdlog::critical("cannot start the gRPC server");
    return 1;
  }
  spdlog::info(
      "serving on {} (uid {}); open-file limit {}, connections at most {} ({} per uid)", config.socket_path,
      ::geteuid(), open_files, connection_limits.total,
      connection_limits.per_uid == 0 ? std::string("no limit") : std::to_string(connection_limits.per_uid));
  if (config.ready_fd >= 0) {
    [[maybe_unused]] ssize_t n = ::write(config.ready_fd, "ready\n", 6);
    ::close(config.ready_fd);
  }
  NotifySystemd("READY=1");

  Acceptor acceptor(listener.get(), peers,
                    [&server](int fd) { grpc::AddInsecureChannelFromFd(server.get(), fd); });
  bool back_off = false;
  for (;;) {
    // While backing off the listener is left out (a negative fd is ignored by poll).
    pollfd fds[2] = {{back_off ? -1 : listener.get(), POLLIN, 0}, {g_signal_pipe[0], POLLIN, 0}};
    const int timeout_ms = back_off ? static_cast<int>(Acceptor::kBackoff.count()) : -1;
    if (::poll(fds, 2, timeout_ms) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents) break;
    back_off = (fds[0].revents & POLLIN) && !acceptor.AcceptPending();
  }
  spdlog::info("stopping: finishing in-flight shards");
  NotifySystemd("STOPPING=1");
  ::unlink(config.socket_path.c_str());
  listener.reset();
  // Waiting calls end now; an idle connection holds nothing up, so once the running calls
  // are done (and their replies sent) the server goes, closing the connections still open.
  service.gate().BeginShutdown();
  if (std::uint64_t running = service.gate().AwaitIdle(std::chrono::steady_clock::now() + kShutdownGrace)) {
    spdlog::warn("{} call(s) still running after {} s; cancelling them", running, kShutdownGrace.count());
  }
  server->Shutdown(std::chrono::system_clock::now() + kReplyFlush);
  daemon.value()->Shutdown();
  metrics.value()->Stop();  // the final figures, once in-flight shards are done
  if (g_sticky_error) {
    spdlog::critical("stopped after a sticky CUDA error; exit status {}", kStickyErrorExit);
    return kStickyErrorExit;
  }
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  int exit_code = 0;
  auto config = ckpt::ParseConfig(argc, argv, &exit_code);
  if (!config) return exit_code;
  return ckpt::Run(*config);
}
