// FreePorts: TCP ports on 127.0.0.1 that are free now, for tests that start daemons with a
// peer address (issue 17). The ports are bound together, so they differ, then released.
#pragma once

#include <vector>

namespace ckpt::test {

std::vector<int> FreePorts(int n);

}  // namespace ckpt::test
