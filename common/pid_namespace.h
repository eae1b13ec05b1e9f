// The PID namespace of a process, as /proc/PID/ns/pid names it ("pid:[4026531836]"). Two
// processes share a PID namespace exactly when the names are equal; a pid one process
// reports means the same process to another only then.
//
// Thread-safety: reads of /proc.
#pragma once

#include <sys/types.h>

#include <string>

#include "common/status.h"

namespace ckpt {

// The PID namespace of process `pid` (0: this process), "pid:[INODE]"; fails when the
// process is gone or /proc refuses (another uid, without ptrace rights over it).
Result<std::string> PidNamespaceOf(pid_t pid);

}  // namespace ckpt
