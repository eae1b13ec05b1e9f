// ShardPath: where a daemon with checkpoint root `root` puts the shard file of `rank` of
// `job` at version `v` (the tree drawn in format/paths.h), for tests that look at the
// files a real ckptd wrote. A pure function: safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace ckpt::test {

std::string ShardPath(const std::string& root, const std::string& job, std::uint64_t v, std::uint32_t rank);

}  // namespace ckpt::test
