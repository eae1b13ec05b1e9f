#include "daemon/metrics/textfile_writer.h"

#include <spdlog/spdlog.h>

namespace ckpt::metrics {

TextfileWriter::TextfileWriter(std::shared_ptr<Storage> storage, std::string path,
                               std::chrono::seconds interval, std::function<std::string()> render)
    : storage_(std::move(storage)), path_(std::move(path)), interval_(interval), render_(std::move(render)) {}

Status TextfileWriter::Start() {
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
