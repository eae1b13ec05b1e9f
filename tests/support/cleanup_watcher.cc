#include "support/cleanup_watcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

namespace ckpt::test {
namespace {

// The test process's end of the watcher's socket (SOCK_SEQPACKET: one message a
// registration, never split or interleaved); -1 when no watcher runs.
std::atomic<int> g_watch_fd{-1};

void Send(const std::string& message) {
  const int fd = g_watch_fd.load();
  if (fd < 0 || message.find('\n') != std::string::npos) return;
  // MSG_NOSIGNAL: a watcher that died must not take the test down with SIGPIPE.
  [[maybe_unused]] ssize_t n = ::send(fd, message.data(), message.size(), MSG_NOSIGNAL);
}

// Field 22 of /proc/PID/stat (clock ticks after boot), 0 if the process is gone.
std::uint64_t StartTime(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::stoull(field);
  }
  return 0;
}

bool Alive(pid_t pid, std::uint64_t start) {
  const std::uint64_t now = StartTime(pid);
  if (now == 0 || now != start) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  return close != std::string::npos && stat.size() > close + 2 && stat[close + 2] != 'Z';
}

void EndProcesses(const std::map<pid_t, std::uint64_t>& pids) {
  for (const auto& [pid, start] : pids) {
    if (Alive(pid, start)) ::kill(pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (const auto& [pid, start] : pids) {
    while (Alive(pid, start)) {
      if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  // A process killed just now still holds what it had open; give it time to go.
  for (const auto& [pid, start] : pids) {
    for (int i = 0; i < 250 && Alive(pid, start); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void RemoveShmOf(pid_t owner) {
  const std::string pid = std::to_string(owner);
  const std::string region = "ckpt-" + std::to_string(::getuid()) + "-" + pid + "-";
  const std::string release = "ckpt-release-" + pid + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(region, 0) == 0 || name.rfind(release, 0) == 0) ::shm_unlink(("/" + name).c_str());
  }
}

[[noreturn]] void Watch(int fd, pid_t owner) {
  std::map<pid_t, std::uint64_t> pids;
  std::map<std::string, int> paths;
  std::string buf(8192, '\0');
  for (;;) {
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // every holder of the other end is gone
    const std::string m(buf.data(), static_cast<std::size_t>(n));
    if (m.size() < 3) continue;
    const std::string arg = m.substr(3);
    if (m.rfind("P+ ", 0) == 0) {
      const pid_t pid = static_cast<pid_t>(std::stol(arg));
      if (const std::uint64_t start = StartTime(pid)) pids[pid] = start;
    } else if (m.rfind("P- ", 0) == 0) {
      pids.erase(static_cast<pid_t>(std::stol(arg)));
    } else if (m.rfind("D+ ", 0) == 0) {
      ++paths[arg];
    } else if (m.rfind("D- ", 0) == 0) {
      if (auto it = paths.find(arg); it != paths.end() && --it->second == 0) paths.erase(it);
    }
  }
  EndProcesses(pids);
  std::error_code ec;
  for (const auto& [path, count] : paths) std::filesystem::remove_all(path, ec);
  RemoveShmOf(owner);
  ::_exit(0);
}

}  // namespace

void StartCleanupWatcher() {
  if (g_watch_fd.load() >= 0) return;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) return;
  const pid_t owner = ::getpid();
  const pid_t middle = ::fork();
  if (middle < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return;
  }
  if (middle == 0) {
    ::close(fds[0]);
    // Its own session, and re-parented to init by the exit of the middle process: a runner
    // that kills the test's process group or its tree of children does not kill the watcher.
    ::setsid();
    if (::fork() != 0) ::_exit(0);
    ::signal(SIGINT, SIG_IGN);
    ::signal(SIGHUP, SIG_IGN);
    ::signal(SIGTERM, SIG_IGN);
    // Nothing of the test's held open (a runner waits for its output pipe to close).
    const int null = ::open("/dev/null", O_RDWR);
    for (int std_fd = 0; std_fd <= 2; ++std_fd) ::dup2(null, std_fd);
    const int keep = ::fcntl(fds[1], F_DUPFD, 100);
    for (int other = 3; other < 100; ++other) ::close(other);
    ::close_range(static_cast<unsigned>(keep) + 1, ~0u, 0);
    Watch(keep, owner);
  }
  ::close(fds[1]);
  int status = 0;
  ::waitpid(middle, &status, 0);
  g_watch_fd.store(fds[0]);
}

void WatchProcess(pid_t pid) { Send("P+ " + std::to_string(pid)); }
void UnwatchProcess(pid_t pid) { Send("P- " + std::to_string(pid)); }
void WatchPath(const std::string& path) { Send("D+ " + path); }
void UnwatchPath(const std::string& path) { Send("D- " + path); }

}  // namespace ckpt::test
