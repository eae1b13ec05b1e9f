// Scratch directories for tests: unique per test, removed when the object goes away, or by
// the cleanup watcher (cleanup_watcher.h) when a signal ends the test first.
#pragma once

#include <string>
#include <vector>

namespace ckpt::test {

class TempDir {
 public:
  // Creates a fresh directory under $CKPT_TEST_TMPDIR (default /tmp).
  explicit TempDir(const std::string& tag = "t");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Reads a whole file; throws if it cannot.
std::string ReadFile(const std::string& path);
// Recursively lists regular files under `dir` (paths relative to it), sorted.
std::vector<std::string> ListFiles(const std::string& dir);

}  // namespace ckpt::test
