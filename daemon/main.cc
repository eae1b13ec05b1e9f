// ckptd: the node-local checkpoint daemon.
//
// Sets up the socket (a directory it creates 0700 plus search permission for whom
// --socket-mode admits, the socket itself --socket-mode and --socket-group), accepts
// connections itself (rpc/acceptor.h: SO_PEERCRED, the connection limits, no spinning when
// descriptors run out), and hands them to a gRPC server that runs CheckpointService
// (daemon/rpc/) over the Daemon's parts (daemon/daemon.h). Picks the implementations: POSIX
// storage, the shm importer, the CUDA backend where built. SIGTERM/SIGINT stop it
// gracefully: no new calls, waiting calls end at once, running ones get up to
// kShutdownGrace, in-flight shards finish. SIGHUP reopens the log file and reloads what can
// change safely (Reload). Readiness is announced on --ready-fd and to systemd
// (NOTIFY_SOCKET). Exit statuses: docs/ops/service.md.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
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
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "common/safe_file.h"
#include "common/socket_path.h"
#include "common/unique_fd.h"
#include "daemon/base/config.h"
#include "daemon/daemon.h"
#include "daemon/io/fault_storage.h"
#include "daemon/io/shm_importer.h"
#include "daemon/base/log.h"
#include "daemon/exposition/metrics_export.h"
#include "daemon/rpc/acceptor.h"
#include "daemon/session/peer_registry.h"
#include "daemon/rpc/service.h"
#include "format/paths.h"
#ifdef CKPT_HAVE_CUDA
#include "cuda/cuda_backend.h"
#include "cuda/cuda_error.h"
#endif
#ifdef CKPTD_TEST_DEVICE_SEAM
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

// What a byte on the signal pipe means: stop (SIGTERM, SIGINT), a sticky CUDA error, or
// reload (SIGHUP).
constexpr char kStopSignal = 1;
constexpr char kStickySignal = 2;
constexpr char kReloadSignal = 3;

void OnSignal(int sig) {
  char c = sig == SIGHUP ? kReloadSignal : kStopSignal;
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

// Exit statuses (docs/ops/service.md): 0 stopped cleanly, 1 a runtime failure (the root
// cannot be recovered, another daemon serves the socket, ...), 2 a usage or configuration
// error (systemd's RestartPreventExitStatus=2: restarting cannot fix it), and
// kStickyErrorExit. A Status of kInvalidArgument from the checks below is a configuration
// error; any other is a runtime failure.
constexpr int kRuntimeFailureExit = 1;
constexpr int kConfigErrorExit = 2;

int ExitCodeFor(const Status& s) {
  return s.code() == StatusCode::kInvalidArgument ? kConfigErrorExit : kRuntimeFailureExit;
}

// The advice when a non-root daemon cannot use the default socket's directory.
std::string NotRootHint(const std::string& path) {
  if (::geteuid() == 0) return "";
  return "; ckptd runs as uid " + std::to_string(::geteuid()) +
         ", not root: serve on a socket it may create, " + "with --socket PATH or CKPTD_SOCKET=PATH" +
         (path == kSystemSocketPath ? " (/run/ckptd is root's)" : "");
}

// Search permission on the socket's directory for whoever --socket-mode lets connect:
// without it a socket mode of 0660 would admit nobody but the owner.
mode_t SocketDirMode(std::uint32_t socket_mode) {
  return 0700 | ((socket_mode & 0070) ? 0010 : 0) | ((socket_mode & 0007) ? 0001 : 0);
}

// The socket's directory: created if missing (0700, plus search permission as
// SocketDirMode says, in --socket-group; with `create` false only checked that it could be),
// refused if others can write to it. An existing one is left as it is (a warning says when
// it keeps out those the socket mode admits).
Status PrepareSocketDir(const Config& config, bool create) {
  const std::string& socket_path = config.socket_path;
  const mode_t want = SocketDirMode(config.socket_mode);
  std::string dir = socket_path.substr(0, socket_path.find_last_of('/'));
  if (dir.empty()) return Status::Ok();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      return InvalidArgument("socket directory " + dir + ": " + std::strerror(errno) +
                             NotRootHint(socket_path));
    }
    const std::string parent = dir.substr(0, std::max<std::size_t>(dir.find_last_of('/'), 1));
    if (!create) {
      if (::access(parent.c_str(), W_OK | X_OK) != 0) {
        return InvalidArgument("cannot create socket directory " + dir + ": " + parent + ": " +
                               std::strerror(errno) + NotRootHint(socket_path));
      }
      return Status::Ok();
    }
    if (::mkdir(dir.c_str(), 0700) != 0) {
      return InvalidArgument("cannot create socket directory " + dir + ": " + std::strerror(errno) +
                             NotRootHint(socket_path));
    }
    // Ours, just made: its group and mode may be set (the umask would have narrowed mkdir's).
    if (config.socket_group) {
      [[maybe_unused]] int rc = ::chown(dir.c_str(), static_cast<uid_t>(-1), *config.socket_group);
    }
    ::chmod(dir.c_str(), want);
    return Status::Ok();
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("socket directory " + dir + " is not a directory");
  if ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX)) {
    return InvalidArgument("socket directory " + dir + " is writable by everyone; refusing to serve there");
  }
  if (create && (st.st_mode & want) != want) {
    spdlog::warn(
        "socket directory {} is mode {:04o}: --socket-mode {:04o} admits others, but they cannot reach "
        "the socket without search permission on the directory ({:04o}; systemd: RuntimeDirectoryMode=)",
        dir, st.st_mode & 07777, config.socket_mode, want);
  }
  return Status::Ok();
}

// The tiers' directories exist (or --create-root asks for them) and are directories.
// Checked before anything is created, so that a file system that is not mounted yet stops
// the start instead of filling the disk under its mount point.
Status CheckTierDirs(const Config& config, Storage& storage) {
  for (const auto& [flag, dir] : {std::pair<std::string, std::string>{"--root", config.root},
                                  std::pair<std::string, std::string>{"--local", config.local_dir}}) {
    if (dir.empty()) continue;
    if (!storage.Exists(dir)) {
      if (config.create_root) continue;
      return InvalidArgument(
          flag + " " + dir +
          " does not exist (is its file system mounted?); create it, or pass --create-root "
          "(create-root = true in the config file) to have ckptd create it");
    }
    if (auto listed = storage.List(dir); !listed.ok()) {
      return InvalidArgument(flag + " " + dir +
                             " is not a directory ckptd can use: " + listed.status().message());
    }
  }
  return Status::Ok();
}

// One daemon per socket, decided before the new one touches the root. A second daemon
// started on the same socket (by hand beside the unit, or a restart loop) would otherwise
// run recovery first, and recovery removes the temporary files of this node id, which are
// the live daemon's shards in flight. The lock is a file beside the socket, held (flock)
// for the daemon's life and never removed, so that no two daemons can hold two different
// files of the same name.
Result<UniqueFd> LockSocket(const Config& config) {
  if (Status s = PrepareSocketDir(config, /*create=*/true); !s.ok()) return s;
  const std::string path = config.socket_path + ".lock";
  // Kept as it is: its bytes mean nothing, the lock is all.
  auto opened = OpenRegularForWrite(path, ExistingFile::kKeep, 0, 0600);
  if (!opened.ok()) {
    const int err = errno;
    if (opened.status().code() == StatusCode::kIoError && (err == EACCES || err == EPERM || err == EROFS))
      return InvalidArgument("cannot create " + path + ": " + std::strerror(err) +
                             NotRootHint(config.socket_path));
    return opened.status();
  }
  UniqueFd fd = std::move(opened).value();
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      return FailedPrecondition("another daemon is serving " + config.socket_path + " (it holds " + path +
                                ")");
    return IoError("flock " + path, errno);
  }
  return fd;
}

Result<UniqueFd> Listen(const Config& config) {
  sockaddr_un addr{};
  if (config.socket_path.size() >= sizeof addr.sun_path) {
    return InvalidArgument("socket path " + config.socket_path + " is too long (max " +
                           std::to_string(sizeof addr.sun_path - 1) + " bytes)");
  }
  if (Status s = PrepareSocketDir(config, /*create=*/true); !s.ok()) return s;
  // Non-blocking: the accept loop takes what is pending and returns to poll().
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return IoError("socket", errno);
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, config.socket_path.c_str());
  // A socket file left by a daemon that died is replaced; a live daemon is not. (A runtime
  // failure, not a configuration error: the other daemon may be on its way out.)
  if (::access(config.socket_path.c_str(), F_OK) == 0) {
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      return FailedPrecondition("another daemon is serving " + config.socket_path);
    }
    ::unlink(config.socket_path.c_str());
  }
  mode_t old = ::umask(0777 & ~config.socket_mode);
  int rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old);
  if (rc != 0) {
    const int err = errno;
    std::string what = "cannot bind " + config.socket_path + ": " + std::strerror(err);
    if (err == EACCES || err == EPERM || err == EROFS)
      return InvalidArgument(what + NotRootHint(config.socket_path));
    return IoError("bind " + config.socket_path, err);
  }
  if (config.socket_group && ::fchownat(AT_FDCWD, config.socket_path.c_str(), static_cast<uid_t>(-1),
                                        *config.socket_group, AT_SYMLINK_NOFOLLOW) != 0) {
    const int err = errno;
    ::unlink(config.socket_path.c_str());
    return InvalidArgument("--socket-group " + std::to_string(*config.socket_group) + ": cannot give " +
                           config.socket_path + " to that group: " + std::strerror(err));
  }
  ::chmod(config.socket_path.c_str(), config.socket_mode);
  if (::listen(fd.get(), 128) != 0) return IoError("listen on " + config.socket_path, errno);
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

// The `key=value` lines of Config::effective, by key.
std::map<std::string, std::string> EffectiveValues(const std::string& effective) {
  std::map<std::string, std::string> values;
  std::istringstream in(effective);
  for (std::string line; std::getline(in, line);) {
    const std::size_t eq = line.find('=');
    if (eq != std::string::npos && !line.empty() && line[0] != '#' && line[0] != '[') {
      values[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return values;
}

// The keys a reload applies to the running daemon. Everything else is read once at start
// (sizes allocated then, threads started, the socket bound, the gRPC server's channel
// arguments fixed): a change is logged as needing a restart.
const std::set<std::string> kReloadedKeys = {"log-level", "keep-last", "keep-every"};

// SIGHUP: reopens the log file, then reads the flags and the config file again and applies
// the keys in kReloadedKeys. A config that does not parse changes nothing.
void Reload(int argc, char** argv, Config& running, LogSink& sink, Daemon& daemon) {
  if (Status s = sink.Reopen(); !s.ok()) {
    spdlog::error("SIGHUP: cannot reopen the log file ({}); still writing to the one open", s.message());
  }
  std::ostringstream out, err;
  int exit_code = 0;
  auto fresh = ParseConfig(argc, argv, &exit_code, out, err);
  std::string error = err.str();
  if (!fresh) {
    while (!error.empty() && error.back() == '\n') error.pop_back();
    spdlog::error("SIGHUP: the configuration{} does not parse, so the running one is kept: {}",
                  running.config_file.empty() ? std::string() : " in " + running.config_file, error);
    return;
  }
  const auto before = EffectiveValues(running.effective);
  auto after = EffectiveValues(fresh->effective);
  std::vector<std::string> applied, need_restart;
  for (const auto& [key, value] : after) {
    auto old = before.find(key);
    if (old != before.end() && old->second == value) continue;
    const std::string change = key + " " + (old == before.end() ? "(unset)" : old->second) + " -> " + value;
    (kReloadedKeys.count(key) ? applied : need_restart).push_back(change);
  }
  spdlog::set_level(spdlog::level::from_str(fresh->log_level));
  daemon.catalog().SetRetention({fresh->keep_last, fresh->keep_every});
  running.log_level = fresh->log_level;
  running.keep_last = fresh->keep_last;
  running.keep_every = fresh->keep_every;
  // What is in force: the reloaded keys' new values, the others' old ones (so that a change
  // needing a restart is named again at every reload until the restart).
  for (auto& [key, value] : after) {
    if (!kReloadedKeys.count(key) && before.count(key)) value = before.at(key);
  }
  running.effective.clear();
  for (const auto& [key, value] : after) running.effective += key + "=" + value + "\n";
  auto join = [](const std::vector<std::string>& items) {
    std::string text;
    for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
    return text;
  };
  spdlog::info("SIGHUP: log file reopened; configuration read again: {}",
               applied.empty() ? std::string("no reloadable key changed") : "applied " + join(applied));
  if (!need_restart.empty()) {
    spdlog::warn("SIGHUP: changed, but only a restart applies them (still running with the old values): {}",
                 join(need_restart));
  }
}

// --check-config: what a start would refuse for its configuration, without starting.
int CheckConfig(const Config& config) {
  PosixStorage posix;
  Status s = CheckTierDirs(config, posix);
  if (s.ok()) s = PrepareSocketDir(config, /*create=*/false);
  if (s.ok() && config.socket_path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    s = InvalidArgument("socket path " + config.socket_path + " is too long");
  }
  if (s.ok() && !config.log_file.empty()) {
    const std::string dir =
        config.log_file.substr(0, std::max<std::size_t>(config.log_file.find_last_of('/'), 1));
    if (::access(config.log_file.c_str(), W_OK) != 0 && ::access(dir.c_str(), W_OK | X_OK) != 0) {
      s = InvalidArgument("--log-file " + config.log_file + " cannot be written: " + std::strerror(errno));
    }
  }
  std::string metrics_warning;
  if (s.ok()) s = metrics::CheckMetricsConfig(config, &metrics_warning);
  if (!s.ok()) {
    std::cerr << "ckptd: " << s.message() << "\n";
    return kConfigErrorExit;
  }
  if (!metrics_warning.empty()) std::cerr << "ckptd: warning: " << metrics_warning << "\n";
  std::cout << "# ckptd " << CKPTD_VERSION << ": configuration OK"
            << (config.config_file.empty() ? std::string() : " (" + config.config_file + ")") << "\n"
            << config.effective;
  return 0;
}

int Run(Config config, int argc, char** argv) {
  // Before anything else: a SIGHUP from here on reloads instead of killing the daemon.
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) return kRuntimeFailureExit;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  auto sink = LogSink::Make(config.log_file);
  if (!sink.ok()) {
    std::cerr << "ckptd: --log-file: " << sink.status().message() << "\n";
    return kConfigErrorExit;
  }
  LogSink::Install(sink.value());
  {
    PosixStorage posix;
    // The socket's directory too, before recovery touches the root.
    Status s = CheckTierDirs(config, posix);
    if (s.ok()) s = PrepareSocketDir(config, /*create=*/false);
    if (!s.ok()) {
      spdlog::critical("cannot start: {}", s.message());
      return kConfigErrorExit;
    }
  }

  auto socket_lock = LockSocket(config);
  if (!socket_lock.ok()) {
    spdlog::critical("cannot start: {}", socket_lock.status().message());
    return ExitCodeFor(socket_lock.status());
  }

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
    char c = kStickySignal;
    [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
  });
#ifdef CKPTD_TEST_DEVICE_SEAM
  // ckptd-test-device only, a binary of the tests that is never installed: a fake device
  // stands for CUDA when CKPTD_TEST_DEVICE is set (cuda/test_device_backend.h).
  auto test_backend = cuda::MakeTestDeviceBackend();
  if (!test_backend.ok()) {
    spdlog::critical("cannot start: {}", test_backend.status().message());
    return kRuntimeFailureExit;
  }
  if (test_backend.value()) {
    backend = std::move(test_backend).value();
  } else
#endif
  if (auto made = cuda::MakeCudaBackend(); made.ok()) {
    backend = std::move(made).value();
  } else {
    no_backend_reason = made.status().message();
  }
#endif
  auto storage = WrapWithTestFault(std::make_shared<PosixStorage>());  // tests only (fault_storage.h)
  if (!storage.ok()) {
    spdlog::critical("cannot start: {}", storage.status().message());
    return kRuntimeFailureExit;
  }
  auto daemon = Daemon::Create(config, std::move(storage).value(), std::make_unique<ShmImporter>(),
                               std::move(backend), no_backend_reason);
  if (!daemon.ok()) {
    spdlog::critical("cannot start: {}", daemon.status().message());
    return kRuntimeFailureExit;
  }
  // Before the socket exists: a port in use stops the start with nothing left behind.
  auto metrics = metrics::MetricsExport::Start(config, *daemon.value());
  if (!metrics.ok()) {
    spdlog::critical("cannot start: {}", metrics.status().message());
    return ExitCodeFor(metrics.status());
  }
  CheckpointService service(*daemon.value(), &peers);
  auto listened = Listen(config);
  if (!listened.ok()) {
    spdlog::critical("cannot start: {}", listened.status().message());
    return ExitCodeFor(listened.status());
  }
  UniqueFd listener = std::move(listened).value();

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
    return kRuntimeFailureExit;
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
    if (fds[1].revents) {
      char signals[64];
      const ssize_t n = ::read(g_signal_pipe[0], signals, sizeof signals);
      if (n > 0 && std::all_of(signals, signals + n, [](char c) { return c == kReloadSignal; })) {
        Reload(argc, argv, config, *sink.value(), *daemon.value());
        continue;
      }
      if (n > 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
      continue;
    }
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
  if (config->check_config) return ckpt::CheckConfig(*config);
  return ckpt::Run(std::move(*config), argc, argv);
}
