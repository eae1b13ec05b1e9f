// Processes the tests start as someone else, or the toy trainer's usual command line.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "support/daemon_process.h"

namespace ckpt::test {

// Runs `argv` to completion in a forked child that dropped to `uid` (gid `uid` too) with
// `groups` as its supplementary groups: its exit code (120 if it could not drop) and output.
// The caller must be root.
ProcessResult RunAs(uid_t uid, const std::vector<std::string>& argv, const std::vector<gid_t>& groups = {});

// The toy trainer of `job` (rank 0 of 1, 2 tensors of 1 MiB in all, no compute): runs to
// iteration `iters` with a checkpoint each; with `resume` it first restores the newest
// committed version and checks every byte.
std::vector<std::string> ToyTrainerArgs(const std::string& socket, const std::string& job, int iters,
                                        bool resume = false);

}  // namespace ckpt::test
