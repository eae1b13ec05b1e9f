#include "support/daemon_process.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "support/cleanup_watcher.h"
#include "support/test_dirs.h"

namespace ckpt::test {
namespace {

pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int keep_fd, int err_fd = -1,
            const std::vector<std::string>& env = {}, std::uint64_t open_files = 0) {
  // Built before fork: the child of a threaded process must not allocate.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The added variables first: getenv() finds the first of two with one name.
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::dup2(out_fd, 1);
    ::dup2(err_fd >= 0 ? err_fd : out_fd, 2);
    if (keep_fd >= 0) ::fcntl(keep_fd, F_SETFD, 0);
    if (open_files != 0) {
      const rlimit lim{open_files, open_files};
      ::setrlimit(RLIMIT_NOFILE, &lim);
    }
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

DaemonProcess::DaemonProcess(DaemonOptions options) : options_(std::move(options)) {
  // Beside the socket: daemons sharing one root (nodes of a job) keep separate logs.
  log_path_ = options_.socket + ".log";
  const std::string sock_dir = options_.socket.substr(0, options_.socket.find_last_of('/'));
  if (!std::filesystem::exists(sock_dir)) {
    std::filesystem::create_directories(sock_dir);
    ::chmod(sock_dir.c_str(), 0700);  // as the daemon would make it
  }
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  // $CKPTD_BINARY: where a bundle of tests/gpu/bundle.sh put ckptd on a GPU machine (the
  // build path compiled in does not exist there).
  const char* binary = std::getenv("CKPTD_BINARY");
  std::vector<std::string> argv = {!options_.binary.empty()                ? options_.binary
                                   : binary != nullptr && *binary != '\0' ? std::string(binary)
                                                                           : std::string(CKPTD_BINARY),
                                   "--root",
                                   options_.root,
                                   "--socket",
                                   options_.socket,
                                   "--pool-mib",
                                   std::to_string(options_.pool_mib),
                                   "--chunk-mib",
                                   std::to_string(options_.chunk_mib),
                                   "--ready-fd",
                                   std::to_string(ready[1]),
                                   "--log-level",
                                   "debug"};
  if (options_.create_root) argv.push_back("--create-root");
  argv.insert(argv.end(), options_.extra_args.begin(), options_.extra_args.end());
  int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  int err = options_.stderr_path.empty()
                ? -1
                : ::open(options_.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  pid_ = Spawn(argv, log, ready[1], err, options_.env, options_.open_files);
  WatchProcess(pid_);
  ::close(log);
  if (err >= 0) ::close(err);
  ::close(ready[1]);
  pollfd p{ready[0], POLLIN, 0};
  char buf[16] = {};
  int n = ::poll(&p, 1, 60000) > 0 ? static_cast<int>(::read(ready[0], buf, sizeof buf - 1)) : -1;
  ::close(ready[0]);
  if (n <= 0 || std::string(buf).rfind("ready", 0) != 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    UnwatchProcess(pid_);
    pid_ = -1;
    throw std::runtime_error("ckptd did not become ready; its log:\n" + Log());
  }
}

DaemonProcess::~DaemonProcess() {
  if (pid_ <= 0) return;
  // A daemon that does not exit cleanly on SIGTERM (a crash, a sanitizer report) fails
  // the test that used it.
  int rc = Stop();
  if (rc != 0) {
    UNSCOPED_INFO("ckptd log:\n" << Log());
    FAIL_CHECK("ckptd exited with status " << rc << " after SIGTERM");
  }
}

void DaemonProcess::Kill9() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  UnwatchProcess(pid_);
  pid_ = -1;
}

int DaemonProcess::Stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  UnwatchProcess(pid_);
  pid_ = -1;
  return ExitCode(status);
}

std::uint64_t DaemonProcess::PeakRssBytes() const {
  std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      std::uint64_t kib = 0;
      ss >> kib;
      return kib * 1024;
    }
  }
  throw std::runtime_error("no VmHWM for pid " + std::to_string(pid_));
}

std::uint64_t DaemonProcess::CpuTicks() const {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid_) + "/stat");
  // The fields after the command, which is in parentheses and may hold spaces; utime and
  // stime are the 14th and 15th of the line.
  std::istringstream in(stat.substr(stat.rfind(')') + 2));
  std::string field;
  std::uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return utime + stime;
}

std::string DaemonProcess::Log() const {
  try {
    return ReadFile(log_path_);
  } catch (const std::exception&) {
    return "(no log)";
  }
}

std::unique_ptr<v1::Checkpoint::Stub> DaemonProcess::Stub() const {
  return v1::Checkpoint::NewStub(
      grpc::CreateChannel("unix:" + options_.socket, grpc::InsecureChannelCredentials()));
}

v1::StatusReply DaemonProcess::Status() const {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::StatusReply reply;
  grpc::Status s = Stub()->Status(&ctx, v1::StatusRequest(), &reply);
  if (!s.ok()) throw std::runtime_error("Status failed: " + s.error_message());
  return reply;
}

v1::ListReply DaemonProcess::List(const std::string& job) const {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListRequest req;
  req.set_job(job);
  v1::ListReply reply;
  grpc::Status s = Stub()->List(&ctx, req, &reply);
  if (!s.ok()) throw std::runtime_error("List failed: " + s.error_message());
  return reply;
}

int DaemonProcess::WaitExit(std::chrono::milliseconds limit) {
  if (pid_ <= 0) return -1;
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      UnwatchProcess(pid_);
      pid_ = -1;
      return ExitCode(status);
    }
    if (std::chrono::steady_clock::now() >= until) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

ProcessResult RunProcess(const std::vector<std::string>& argv) {
  char path[] = "/tmp/ckpt-test-out-XXXXXX";
  int fd = ::mkstemp(path);
  WatchPath(path);
  pid_t pid = Spawn(argv, fd, -1);
  WatchProcess(pid);
  ::close(fd);
  ProcessResult r;
  r.exit_code = WaitProcess(pid);
  r.output = ReadFile(path);
  ::unlink(path);
  UnwatchPath(path);
  return r;
}

pid_t StartProcess(const std::vector<std::string>& argv, const std::string& log_path) {
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  pid_t pid = Spawn(argv, fd, -1);
  WatchProcess(pid);
  ::close(fd);
  return pid;
}

int WaitProcess(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  UnwatchProcess(pid);
  return ExitCode(status);
}

}  // namespace ckpt::test
