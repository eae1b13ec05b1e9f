#include "daemon/base/log.h"

#include <fcntl.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "common/safe_file.h"

namespace ckpt {
namespace {

constexpr char kTimestampedPattern[] = "%Y-%m-%d %H:%M:%S.%e ckptd[%P] %l: %v";

Result<UniqueFd> OpenLogFile(const std::string& path) {
  auto fd = OpenRegularForWrite(path, ExistingFile::kAppend, 0, 0640);
  if (fd.ok()) return fd;
  // The system's error as it was (errno is kept); a refusal says what is at the path.
  if (fd.status().code() == StatusCode::kIoError) return IoError("open log file " + path, errno);
  return fd.status().With("open log file");
}

char SyslogPriority(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::critical:
      return '2';
    case spdlog::level::err:
      return '3';
    case spdlog::level::warn:
      return '4';
    case spdlog::level::info:
      return '6';
    default:
      return '7';
  }
}

void WriteAll(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere left to report a failing log
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

}  // namespace

int JournalStreamFd() {
  const char* env = std::getenv("JOURNAL_STREAM");
  if (env == nullptr) return -1;
  std::uintmax_t dev = 0, ino = 0;
  if (std::sscanf(env, "%" SCNuMAX ":%" SCNuMAX, &dev, &ino) != 2) return -1;
  for (int fd : {2, 1}) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino) return fd;
  }
  return -1;
}

LogSink::LogSink(Mode mode, std::string path, UniqueFd file, int journal_fd)
    : mode_(mode), path_(std::move(path)), journal_fd_(journal_fd), file_(std::move(file)) {
  formatter_ =
      std::make_unique<spdlog::pattern_formatter>(mode == Mode::kJournal ? "%v" : kTimestampedPattern);
}

Result<std::shared_ptr<LogSink>> LogSink::Make(const std::string& log_file) {
  if (!log_file.empty()) {
    auto fd = OpenLogFile(log_file);
    if (!fd.ok()) return fd.status();
    return std::shared_ptr<LogSink>(new LogSink(Mode::kFile, log_file, std::move(fd).value(), -1));
  }
  const int journal = JournalStreamFd();
  return std::shared_ptr<LogSink>(
      new LogSink(journal >= 0 ? Mode::kJournal : Mode::kTerminal, "", UniqueFd(), journal));
}

void LogSink::Install(std::shared_ptr<LogSink> sink) {
  const spdlog::level::level_enum level = spdlog::get_level();
  auto logger = std::make_shared<spdlog::logger>("ckptd", std::move(sink));
  logger->set_level(level);
  spdlog::set_default_logger(std::move(logger));
}

Status LogSink::Reopen() {
  if (mode_ != Mode::kFile) return Status::Ok();
  auto fd = OpenLogFile(path_);
  if (!fd.ok()) return fd.status();
  MutexLock lock(mu_);
  file_ = std::move(fd).value();
  return Status::Ok();
}

void LogSink::log(const spdlog::details::log_msg& msg) {
  spdlog::memory_buf_t line;
  MutexLock lock(mu_);
  if (mode_ == Mode::kJournal) {
    const char prefix[] = {'<', SyslogPriority(msg.level), '>'};
    line.append(prefix, prefix + sizeof prefix);
  }
  formatter_->format(msg, line);
  int fd = 1;
  if (mode_ == Mode::kFile) {
    fd = file_.get();
  } else if (mode_ == Mode::kJournal) {
    fd = journal_fd_;
  } else if (msg.level >= spdlog::level::warn) {
    fd = 2;
  }
  WriteAll(fd, line.data(), line.size());
}

void LogSink::set_pattern(const std::string& pattern) {
  set_formatter(std::make_unique<spdlog::pattern_formatter>(pattern));
}

void LogSink::set_formatter(std::unique_ptr<spdlog::formatter> formatter) {
  MutexLock lock(mu_);
  formatter_ = std::move(formatter);
}

}  // namespace ckpt
