// Bounds on what the checkpoint tree may claim, shared by every reader and by the daemon's
// checks of requests. The tree lies in directories that a job's owner (or anyone with write
// access to a shared file system) can edit, so a number read from it is a claim, and a
// reader bounds it before it allocates anything of that size.
#pragma once

#include <cstdint>

namespace ckpt {

// The largest world size a registration, a shard header, a COMMITTED marker or an index may
// name: far beyond any job (a million ranks), and small enough that a table with an entry per
// rank of a version is a few MiB, not the GiBs a crafted 2^32 would make it.
inline constexpr std::uint32_t kMaxWorldSize = 1u << 20;

}  // namespace ckpt
