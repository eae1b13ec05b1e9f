// CleanupWatcher: what a test process leaves behind when it dies without running its
// destructors (SIGTERM or SIGINT from timeout or Ctrl-C, which Catch2 reports and re-raises;
// SIGHUP; SIGKILL from a test runner's timeout): nothing.
//
// The test's main starts it (catch_main.cc) before any thread: a watcher process, detached
// (its own session, its parent init), that reads what the test process registers through a
// pipe and, once that pipe closes (the test process is gone, however it ended), ends the
// registered processes still running (SIGTERM, SIGKILL after 10 s; a process is matched by
// its pid and start time, so a reused pid is never hit), removes the registered paths, and
// the shared memory libckpt created in the test process (/dev/shm/ckpt-UID-PID-*,
// /dev/shm/ckpt-release-PID-*), then exits. After a normal exit there is nothing left to do.
//
// DaemonProcess, StartProcess and TempDir register what they create and unregister it once
// it is gone. Registration is one write of at most PIPE_BUF bytes (atomic), from any thread
// or a forked child; it does nothing if the watcher was not started. Thread-safe.
#pragma once

#include <sys/types.h>

#include <string>

namespace ckpt::test {

// Forks the watcher; call once, first thing in main.
void StartCleanupWatcher();

// `pid` is ended if the test process dies while it runs.
void WatchProcess(pid_t pid);
void UnwatchProcess(pid_t pid);
// `path` (a directory goes whole) is removed if the test process dies while it exists.
void WatchPath(const std::string& path);
void UnwatchPath(const std::string& path);

}  // namespace ckpt::test
