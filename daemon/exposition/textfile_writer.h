// TextfileWriter: the --metrics-textfile side: writes the metrics text to a file every
// `interval`, and once more when stopped, for node_exporter's textfile collector. Each
// write is atomic (Storage::WriteFileAtomic: a temporary file in the same directory,
// fdatasync, rename), so the collector never reads half a file; the temporary's name does
// not end in .prom, so the collector skips it. The directory may be one other users can
// write: the temporary file has a random name and is always created new (O_EXCL), so a file
// planted at a name it could have is never written through nor renamed into place. Start()
// removes the temporary files of this node's daemon (PATH.RANDOM.NODE.tmp) that a crash left,
// and warns if the directory is writable by every user without being sticky. A failed
// write is logged and retried at the next interval (the daemon keeps serving). Thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "daemon/io/storage.h"

namespace ckpt::metrics {

class TextfileWriter {
 public:
  TextfileWriter(std::shared_ptr<Storage> storage, std::string path, std::chrono::seconds interval,
                 std::function<std::string()> render);
  ~TextfileWriter();  // Stop()
  TextfileWriter(const TextfileWriter&) = delete;
  TextfileWriter& operator=(const TextfileWriter&) = delete;

  // Writes the file once, now, and then starts writing every interval. An error (the
  // path cannot be written) starts nothing.
  Status Start();
  // Stops the thread and, if Start succeeded, writes the final figures. Idempotent.
  void Stop() EXCLUDES(mu_);

 private:
  Status WriteNow();
  void Loop() EXCLUDES(mu_);

  const std::shared_ptr<Storage> storage_;
  const std::string path_;
  const std::chrono::seconds interval_;
  const std::function<std::string()> render_;
  Mutex mu_;
  CondVar wake_;
  bool stop_ GUARDED_BY(mu_) = false;
  bool stopped_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ckpt::metrics
