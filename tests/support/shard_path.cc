#include "support/shard_path.h"

#include "format/paths.h"

namespace ckpt::test {

std::string ShardPath(const std::string& root, const std::string& job, std::uint64_t v, std::uint32_t rank) {
  return root + "/" + job + "/" + VersionDirName(v) + "/" + ShardFileName(rank);
}

}  // namespace ckpt::test
