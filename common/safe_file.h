// Opening the files and directories of the checkpoint tree (shards, markers, `latest`,
// registration files, the config file) so that whatever lies at the path cannot block or
// redirect the open.
//
// A FIFO blocks open() until a writer comes (and read() until it writes), a device may do
// anything on open, and a symbolic link may point outside the checkpoint root. So every
// open here uses O_NOFOLLOW (a symbolic link as the last component is refused, not
// followed), O_NONBLOCK (a FIFO or device opens at once instead of waiting), O_NOCTTY and
// O_CLOEXEC; before the open, lstat refuses anything but the expected type without opening
// it, and after it fstat checks the descriptor again (the entry may have been swapped in
// between). O_NONBLOCK is cleared once the file is known to be regular, where it means
// nothing anyway. Components above the last one are followed: the root itself may be a
// link, as /var/run is.
//
// Errors name the path and what it is: "ROOT/JOB/latest is a FIFO, not a regular file".
// Thread-safe (no state).
#pragma once

#include <sys/types.h>

#include <string>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

// "a regular file", "a directory", "a FIFO", "a symbolic link", "a character device",
// "a block device", "a socket" or "a file of unknown type", for `st_mode`.
std::string FileTypeName(mode_t mode);

// Opens the regular file `path` read-only; `extra_flags` may add O_DIRECT. Errors:
// NotFound if nothing is there, DataLoss if something else than a regular file is (a FIFO,
// a device, a directory, a symbolic link: the tree does not hold what it should), IoError
// for other failures of the operating system (errno is then the one of the failed open).
Result<UniqueFd> OpenRegularForRead(const std::string& path, int extra_flags = 0);

// Opens `path` for writing, creating it with `mode` or truncating the regular file there;
// `extra_flags` may add O_DIRECT. Nothing is written through a symbolic link, a FIFO or a
// device: if one is at `path`, FailedPrecondition names it and it is left as it is.
Result<UniqueFd> CreateRegularFile(const std::string& path, int extra_flags, mode_t mode);

// Opens the directory `path` (O_DIRECTORY, for fsync or listing). NotFound if nothing is
// there, FailedPrecondition if something else is (a symbolic link included).
Result<UniqueFd> OpenDirectory(const std::string& path);

}  // namespace ckpt
