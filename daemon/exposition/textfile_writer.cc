#include "daemon/exposition/textfile_writer.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>

#include "format/paths.h"

namespace ckpt::metrics {

TextfileWriter::TextfileWriter(std::shared_ptr<Storage> storage, std::string path,
                               std::chrono::seconds interval, std::function<std::string()> render)
    : storage_(std::move(storage)), path_(std::move(path)), interval_(interval), render_(std::move(render)) {}

namespace {

// Whether `name` is a temporary file WriteFileAtomic made for `base`: base.RANDOM + TmpSuffix(),
// RANDOM 16 hex digits (RandomHex).
bool IsOwnTemporary(const std::string& name, const std::string& base) {
  const std::string& suffix = TmpSuffix();
  constexpr std::size_t kRandom = 16;
  if (name.size() != base.size() + 1 + kRandom + suffix.size() || name.compare(0, base.size(), base) != 0 ||
      name[base.size()] != '.' || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(base.size() + 1),
                     name.begin() + static_cast<std::ptrdiff_t>(base.size() + 1 + kRandom),
                     [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
}

}  // namespace

Status TextfileWriter::Start() {
  const std::size_t slash = path_.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
  const std::string base = slash == std::string::npos ? path_ : path_.substr(slash + 1);
  // Temporary files left by a daemon of this node that died between a write and its rename
  // (their names are random, so no later write replaces them).
  if (auto names = storage_->List(dir); names.ok()) {
    for (const std::string& name : names.value()) {
      if (IsOwnTemporary(name, base)) storage_->Remove(JoinPath(dir, name));
    }
  }
  // In a directory every user can write that is not sticky, anyone can rename the file the
  // collector reads, or the temporary file before its rename: nothing the daemon does helps.
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0 && (st.st_mode & S_IWOTH) != 0 && (st.st_mode & S_ISVTX) == 0) {
    spdlog::warn(
        "metrics textfile {}: its directory {} is writable by every user and not sticky, so any of "
        "them can replace what node_exporter reads; chmod +t {} (or make it writable by the daemon "
        "only)",
        path_, dir, dir);
  }
  if (Status s = WriteNow(); !s.ok()) return s;
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

TextfileWriter::~TextfileWriter() { Stop(); }

Status TextfileWriter::WriteNow() {
  // Readable by all: node_exporter runs as a user of its own, and the same text is served
  // to anyone who reaches --metrics-listen.
  if (Status s = storage_->WriteFileAtomic(path_, render_(), 0644); !s.ok())
    return s.With("metrics textfile " + path_);
  return Status::Ok();
}

void TextfileWriter::Loop() {
  MutexLock lock(mu_);
  for (;;) {
    const auto next = std::chrono::steady_clock::now() + interval_;
    while (!stop_ && std::chrono::steady_clock::now() < next) wake_.WaitUntil(mu_, next);
    if (stop_) return;
    lock.Unlock();
    if (Status s = WriteNow(); !s.ok()) spdlog::warn("{}; retrying in {} s", s.message(), interval_.count());
    lock.Lock();
  }
}

void TextfileWriter::Stop() {
  {
    MutexLock lock(mu_);
    if (stopped_) return;
    stop_ = stopped_ = true;
  }
  wake_.SignalAll();
  if (!thread_.joinable()) return;  // never started
  thread_.join();
  // The figures of the end: in-flight shards have finished by now.
  if (Status s = WriteNow(); !s.ok()) spdlog::warn("{}", s.message());
}

}  // namespace ckpt::metrics
