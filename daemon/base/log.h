// LogSink: where ckptd's log goes, chosen once at start.
//
// - Under systemd (JOURNAL_STREAM names the device and inode of our stderr or stdout):
//   each line is the message with a syslog priority prefix (<2> critical, <3> error,
//   <4> warning, <6> info, <7> debug and trace) and no timestamp or pid, which journald
//   adds itself; the prefix gives journalctl -p its levels.
// - With --log-file: every line, timestamped, appended to that file; Reopen() (SIGHUP)
//   opens the path again, so that logrotate can move the file away.
// - Otherwise: timestamped lines, warnings and worse on stderr, the rest on stdout.
//
// The log file is opened directly rather than through Storage: Storage is the checkpoint
// tree's (and the test fault seam's), and the log must keep working when that fails. It is
// opened as common/safe_file.h says (OpenRegularForWrite): the log directory may be one other
// users can write, so a symbolic link, a FIFO or a file not owned by the daemon's uid at the
// path is refused without being followed, waited on or written; Reopen() then keeps the
// file open before.
#pragma once

#include <spdlog/sinks/sink.h>

#include <memory>
#include <string>

#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

class LogSink final : public spdlog::sinks::sink {
 public:
  enum class Mode { kTerminal, kJournal, kFile };

  // Opens `log_file` ("" for none) and picks the mode from it and the environment.
  static Result<std::shared_ptr<LogSink>> Make(const std::string& log_file);
  // Makes this sink spdlog's default logger's only one.
  static void Install(std::shared_ptr<LogSink> sink);

  Mode mode() const { return mode_; }
  // Opens the log file's path again (kFile; a no-op otherwise). On failure the old file is
  // kept and the error returned.
  Status Reopen() EXCLUDES(mu_);

  void log(const spdlog::details::log_msg& msg) override EXCLUDES(mu_);
  void flush() override {}
  void set_pattern(const std::string& pattern) override EXCLUDES(mu_);
  void set_formatter(std::unique_ptr<spdlog::formatter> formatter) override EXCLUDES(mu_);

 private:
  LogSink(Mode mode, std::string path, UniqueFd file, int journal_fd);

  const Mode mode_;
  const std::string path_;
  // kJournal: the descriptor JOURNAL_STREAM names (2 or 1).
  const int journal_fd_;
  Mutex mu_;
  UniqueFd file_ GUARDED_BY(mu_);
  std::unique_ptr<spdlog::formatter> formatter_ GUARDED_BY(mu_);
};

// The descriptor (2, else 1) that $JOURNAL_STREAM ("DEVICE:INODE") says is connected to
// the journal; -1 if it is unset or names neither (a child whose output was redirected
// inherits the variable, and must not send prefixes to a terminal or file).
int JournalStreamFd();

}  // namespace ckpt
