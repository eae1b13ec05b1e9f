// Binding of the shard reader (format/shard_format.h) for ckpt.load_file / load_version:
// reads and verifies shard files without a daemon.
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt::python {

// Adds read_shard(path, verify=True) and read_shard_header(path) to `m`. Failures raise
// ckpt.Error (through the module's translator of ckpt::Error) or OSError for a file that
// cannot be opened (FileNotFoundError when it does not exist).
void BindShardReader(pybind11::module_& m);

}  // namespace ckpt::python
