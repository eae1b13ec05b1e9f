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
// Writing has two more rules, for files in directories other users may write (a log
// directory, node_exporter's textfile directory, a job's directory, which its owner can
// write). An existing file is written only if it is this process's own: a regular file owned
// by the effective uid with one link, so that neither a file another user planted (which its
// planter could still change, through a descriptor kept open) nor a hard link to someone
// else's file is written through; it is opened without O_TRUNC and emptied only once
// checked. And a temporary file is always created new (O_EXCL), under a name no one can guess
// (RandomHex), so that nothing planted at a name the daemon writes is ever opened.
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

// What OpenRegularForWrite does with a file of this process's own that is already there.
enum class ExistingFile {
  kTruncate,  // empties it
  kAppend,    // writes at its end (O_APPEND: a log)
  kKeep,      // leaves its bytes as they are (a lock file)
};

// Opens `path` for writing, creating it with `mode`, or opening the file there as `existing`
// says; `extra_flags` may add O_DIRECT. Nothing is written through a symbolic link, a FIFO,
// a device, a file of another owner or a file with other links: if one is at `path`,
// FailedPrecondition names it (and its owner, or its links) and it is left as it is.
Result<UniqueFd> OpenRegularForWrite(const std::string& path, ExistingFile existing, int extra_flags,
                                     mode_t mode);

// OpenRegularForWrite(path, ExistingFile::kTruncate, extra_flags, mode).
Result<UniqueFd> CreateRegularFile(const std::string& path, int extra_flags, mode_t mode);

// Creates `path` with `mode` and opens it for writing; whatever is there already (a file, a
// FIFO, a symbolic link, dangling or not) is not opened: AlreadyExists names it.
Result<UniqueFd> CreateNewRegularFile(const std::string& path, int extra_flags, mode_t mode);

// Checks that the open `fd` (of `path`) is a file this process may write through: a regular
// file owned by the effective uid, with one link. FailedPrecondition saying what it is else.
Status CheckOwnRegularFile(int fd, const std::string& path);

// 16 hex digits from the kernel's random source (getrandom), for temporary names that no
// other user can guess and plant a file at.
std::string RandomHex();

// Opens the directory `path` (O_DIRECTORY, for fsync or listing). NotFound if nothing is
// there, FailedPrecondition if something else is (a symbolic link included).
Result<UniqueFd> OpenDirectory(const std::string& path);

}  // namespace ckpt
