// Files the daemon opens by a path an operator chose (--log-file, --metrics-textfile) may lie
// in directories other users can write. What another user plants there must not redirect
// root's daemon, block it, or be written through (common/safe_file.h):
//   - the log file is reopened at SIGHUP (logrotate) without following a symbolic link,
//     without waiting on a FIFO, and only if it is the daemon's own file;
//   - the metrics textfile is written through a temporary file of an unguessable name,
//     created new (O_EXCL), never through a file that was there.
// Each refusal is logged and the daemon keeps serving: a fresh client connection is
// accepted at once, checked with a real call, not with a sleep.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string ReadOr(const std::string& path, const std::string& otherwise = "") {
  try {
    return ReadFile(path);
  } catch (const std::exception&) {
    return otherwise;
  }
}

// A call on a new connection, answered within `limit`: the accept loop is not blocked.
bool AnswersNewClient(const DaemonProcess& daemon, std::chrono::seconds limit = std::chrono::seconds(5)) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + limit);
  v1::StatusReply reply;
  grpc::Status s = daemon.Stub()->Status(&ctx, v1::StatusRequest(), &reply);
  INFO("Status: " << s.error_message());
  return s.ok();
}

// A daemon logging to DIR/logs/ckptd.log, a directory other users could write (1777).
struct LoggingDaemon {
  LoggingDaemon() : log_dir(Prepare(dir)), log(log_dir + "/ckptd.log"), daemon(Options(dir, log)) {}
  static std::string Prepare(const TempDir& d) {
    const std::string logs = d.path() + "/logs";
    fs::create_directory(logs);
    fs::permissions(logs, fs::perms::all | fs::perms::sticky_bit);
    return logs;
  }
  static DaemonOptions Options(const TempDir& d, const std::string& log) {
    DaemonOptions o;
    o.root = d.path() + "/root";
    o.socket = d.path() + "/sock/ckptd.sock";
    o.extra_args = {"--memory-mib", "0", "--log-file", log};
    return o;
  }
  // What logrotate does before SIGHUP: the file moves away (the daemon still writes to it).
  std::string Rotate() {
    const std::string rotated = log + ".1";
    fs::rename(log, rotated);
    return rotated;
  }
  // SIGHUP; true once the daemon logged (to the rotated file) that it kept the old one.
  bool ReopenRefused(const std::string& rotated) {
    REQUIRE(::kill(daemon.pid(), SIGHUP) == 0);
    return Eventually([&] { return Contains(ReadOr(rotated), "cannot reopen the log file"); },
                      std::chrono::seconds(10));
  }

  TempDir dir{"opened"};
  std::string log_dir, log;
  DaemonProcess daemon;
};

}  // namespace

TEST_CASE("a symbolic link planted at the log path is not followed at SIGHUP", "[files][log]") {
  LoggingDaemon d;
  REQUIRE(Eventually([&] { return Contains(ReadOr(d.log), "serving on"); }, std::chrono::seconds(10)));
  const std::string target = d.dir.path() + "/target";
  std::ofstream(target) << "untouched\n";
  const std::string rotated = d.Rotate();
  fs::create_symlink(target, d.log);
  CHECK(d.ReopenRefused(rotated));
  CHECK(Contains(ReadOr(rotated), d.log + " is a symbolic link"));
  CHECK(AnswersNewClient(d.daemon));
  CHECK(ReadFile(target) == "untouched\n");
  CHECK(fs::is_symlink(fs::symlink_status(d.log)));
}

TEST_CASE("a FIFO planted at the log path does not block the accept loop at SIGHUP", "[files][log]") {
  LoggingDaemon d;
  REQUIRE(Eventually([&] { return Contains(ReadOr(d.log), "serving on"); }, std::chrono::seconds(10)));
  const std::string rotated = d.Rotate();
  REQUIRE(::mkfifo(d.log.c_str(), 0666) == 0);
  const bool refused = d.ReopenRefused(rotated);
  const bool answered = AnswersNewClient(d.daemon);
  // A daemon stuck in open() on the FIFO gets a reader, so that it can be stopped.
  const int reader = ::open(d.log.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  CHECK(refused);
  CHECK(answered);
  CHECK(Contains(ReadOr(rotated), d.log + " is a FIFO"));
  d.daemon.Stop();
  if (reader >= 0) ::close(reader);
}

TEST_CASE("a log file another user owns at the log path is not appended to at SIGHUP", "[files][log]") {
  LoggingDaemon d;
  REQUIRE(Eventually([&] { return Contains(ReadOr(d.log), "serving on"); }, std::chrono::seconds(10)));
  const std::string rotated = d.Rotate();
  std::ofstream(d.log) << "planted\n";
  REQUIRE(::chown(d.log.c_str(), 65534, 65534) == 0);
  CHECK(d.ReopenRefused(rotated));
  CHECK(Contains(ReadOr(rotated), "owned by uid 65534"));
  CHECK(AnswersNewClient(d.daemon));
  CHECK(ReadFile(d.log) == "planted\n");
}

TEST_CASE("a file planted at the textfile's temporary name is neither written through nor renamed",
          "[files][metrics]") {
  TempDir dir("opened");
  // node_exporter's textfile directory, writable by other users (sticky, as /tmp).
  const std::string textdir = dir.path() + "/textfile";
  fs::create_directory(textdir);
  fs::permissions(textdir, fs::perms::all | fs::perms::sticky_bit);
  const std::string prom = textdir + "/ckptd.prom";
  // The name an attacker would predict: PATH.NODE.tmp, what a fixed temporary name would be.
  const std::string planted = prom + ".node.tmp";
  const int fd = ::open(planted.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "planted 1\n", 10) == 10);
  struct stat planted_st {};
  REQUIRE(::fstat(fd, &planted_st) == 0);
  // What a daemon of this node that died between a write and its rename leaves.
  const std::string leftover = prom + ".0123456789abcdef.node.tmp";
  std::ofstream(leftover) << "stale 1\n";

  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--memory-mib", "0", "--node-id", "node", "--metrics-textfile", prom};
  DaemonProcess daemon(o);
  REQUIRE(Eventually([&] { return fs::exists(prom); }, std::chrono::seconds(10)));
  struct stat prom_st {};
  REQUIRE(::lstat(prom.c_str(), &prom_st) == 0);
  CHECK(prom_st.st_ino != planted_st.st_ino);
  CHECK(prom_st.st_uid == ::geteuid());
  CHECK(ReadOr(planted) == "planted 1\n");
  CHECK_FALSE(fs::exists(leftover));
  // Whoever holds the planted file open does not control what the collector reads.
  REQUIRE(::pwrite(fd, "evil_metric 1\n", 14, 0) == 14);
  const std::string text = ReadFile(prom);
  CHECK(Contains(text, "ckptd_"));
  CHECK_FALSE(Contains(text, "evil_metric"));
  CHECK_FALSE(Contains(text, "planted"));
  ::close(fd);
  CHECK(AnswersNewClient(daemon));
  // No temporary file of the daemon's is left beside the textfile.
  for (const auto& e : fs::directory_iterator(textdir)) {
    const std::string name = e.path().filename().string();
    CHECK((name == "ckptd.prom" || name == "ckptd.prom.node.tmp"));
  }
}
