#include "tools/ckptctl/committed_version.h"

#include <sys/stat.h>

#include <filesystem>
#include <system_error>

namespace ckptctl {

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::uint64_t NewestCommitted(const ckpt::CheckpointTree& tree, const std::string& job) {
  std::uint64_t newest = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(tree.JobDir(job), ec)) {
    auto v = ckpt::ParseVersionDirName(e.path().filename().string());
    if (v && *v > newest && PathExists(tree.CommittedMarker(job, *v))) newest = *v;
  }
  return newest;
}

ckpt::Result<std::uint64_t> ChooseVersion(const ckpt::CheckpointTree& tree, const std::string& job,
                                          std::uint64_t version) {
  const std::string& root = tree.root();
  if (!PathExists(tree.JobDir(job)))
    return ckpt::NotFound("no job '" + job + "' under " + root + " (" + tree.JobDir(job) +
                          " does not exist)");
  if (version == 0) {
    version = NewestCommitted(tree, job);
    if (version == 0) return ckpt::NotFound("job '" + job + "' under " + root + " has no committed version");
  }
  const std::string dir = tree.VersionDir(job, version);
  if (!PathExists(dir))
    return ckpt::NotFound("job '" + job + "' has no version " + std::to_string(version) + " under " + root +
                          " (" + dir + " does not exist)");
  return version;
}

}  // namespace ckptctl
