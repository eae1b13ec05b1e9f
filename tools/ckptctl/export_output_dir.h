// The output directory of an export (export.h) while it is written: the files go into a
// temporary directory inside it and are renamed into it at the end, so that a failed or
// interrupted export leaves it as it was. Not part of export.h's interface.
//
// Not thread-safe: one export at a time, on one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckptctl::export_internal {

// One output file being written, under its temporary path.
struct OutFile {
  std::string path;
  ckpt::UniqueFd fd;
};

// Unless committed, the destructor removes the temporary directory, and the output directory
// too if this export created it.
class OutputDir {
 public:
  OutputDir() = default;
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;
  ~OutputDir();

  // Takes `out` (created if missing, with its parents) and makes the temporary directory in
  // it. InvalidArgument for an empty path, FailedPrecondition for one that is not a directory,
  // AlreadyExists for a directory that holds anything and !force, IoError naming the path.
  ckpt::Status Open(const std::string& out, bool force);

  // A new file `name` under the temporary directory, with room for `bytes` made now (a full
  // disk fails before hours of copying, not after). IoError naming the file.
  ckpt::Result<OutFile> Create(const std::string& name, std::uint64_t bytes);

  // Renames every file into the output directory, the index last, then removes what an
  // earlier export left there that this one does not replace.
  ckpt::Status Commit();

 private:
  std::string out_, tmp_, created_;
  std::vector<std::string> existing_;  // what was in the directory before
  std::vector<std::string> names_;     // the files written under tmp_
  bool committed_ = false;
};

}  // namespace ckptctl::export_internal
