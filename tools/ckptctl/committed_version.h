// Which version of a job a ckptctl command reads when it reads the checkpoint tree itself,
// with no daemon (export, verify, inspect): the one asked for by number, or else the newest
// committed one. One rule for all of them, with the same messages.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "format/paths.h"

namespace ckptctl {

// Whether anything is at `path`: a symbolic link counts, and is not followed.
bool PathExists(const std::string& path);

// The newest version of `job` with a COMMITTED marker (what every reader restores; the
// `latest` file is only a pointer), 0 if none.
std::uint64_t NewestCommitted(const ckpt::CheckpointTree& tree, const std::string& job);

// `version` of `job` (0: the newest committed), whose directory is there. NotFound, naming the
// tree's root and the path that is missing, for a job without a directory, a job without any
// committed version, or a version without a directory. Whether the version asked for by
// number is committed is the caller's to check.
ckpt::Result<std::uint64_t> ChooseVersion(const ckpt::CheckpointTree& tree, const std::string& job,
                                          std::uint64_t version);

}  // namespace ckptctl
