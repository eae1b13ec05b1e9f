// DaemonProcess: a real ckptd, started for one test and stopped with it.
//
// The constructor starts the binary with --ready-fd and returns once the daemon said it
// serves (no sleeping); it throws with the daemon's log if the daemon exits first. The
// daemon, and each process StartProcess and RunProcess start, is registered with the cleanup
// watcher (cleanup_watcher.h) while it runs: a test killed by a signal leaves none running.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/v1/ckpt.grpc.pb.h"

namespace ckpt::test {

struct DaemonOptions {
  std::string root;    // checkpoint root
  std::string socket;  // socket path
  std::uint64_t pool_mib = 64;
  std::uint64_t chunk_mib = 4;
  std::vector<std::string> extra_args;
  // --create-root: most tests start on a fresh path (a missing root is an error otherwise).
  bool create_root = true;
  // NAME=VALUE pairs added to the daemon's environment.
  std::vector<std::string> env;
  // If set, the daemon's stderr goes here and only its stdout to Log().
  std::string stderr_path;
  // If set, the daemon's open-file limit (soft and hard: it cannot raise it).
  std::uint64_t open_files = 0;
  // If set, the daemon binary to start instead of ckptd (ckptd-test-device, say).
  std::string binary;
};

class DaemonProcess {
 public:
  explicit DaemonProcess(DaemonOptions options);
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& socket() const { return options_.socket; }
  const std::string& root() const { return options_.root; }
  bool running() const { return pid_ > 0; }

  // SIGKILL, then reap.
  void Kill9();
  // SIGTERM, then reap; returns the exit status (or 128+signal).
  int Stop();
  // Waits up to `limit` for the daemon to exit on its own; returns its exit status (or
  // 128+signal), or -1 if it is still running.
  int WaitExit(std::chrono::milliseconds limit);
  // VmHWM (peak resident set) of the running daemon, in bytes.
  std::uint64_t PeakRssBytes() const;
  // CPU time (user + system, all threads) the running daemon has used, in clock ticks.
  std::uint64_t CpuTicks() const;
  // What the daemon logged so far.
  std::string Log() const;
  const std::string& log_path() const { return log_path_; }

  std::unique_ptr<v1::Checkpoint::Stub> Stub() const;
  v1::StatusReply Status() const;
  // The daemon's List of `job` (throws on an error).
  v1::ListReply List(const std::string& job) const;

 private:
  DaemonOptions options_;
  std::string log_path_;
  pid_t pid_ = -1;
};

struct ProcessResult {
  int exit_code = -1;  // 128+signal if killed
  std::string output;  // stdout and stderr together
};

// Runs a program to completion and captures its output.
ProcessResult RunProcess(const std::vector<std::string>& argv);

// Starts a program in the background with its output going to `log_path`.
pid_t StartProcess(const std::vector<std::string>& argv, const std::string& log_path);
// Waits for a started process; returns its exit code (128+signal if killed).
int WaitProcess(pid_t pid);

}  // namespace ckpt::test
