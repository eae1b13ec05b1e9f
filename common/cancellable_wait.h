// WaitInSlices: the one way a daemon call waits for background work (a shard reaching a
// level, a rank's shards settling, room for another version in flight) without pinning a
// thread for a caller that went away. The wait runs in slices of at most kWaitSlice; between
// slices `cancelled()` is asked (for a gRPC call: ServerContext::IsCancelled).
#pragma once

#include <chrono>
#include <functional>

#include "common/status.h"

namespace ckpt {

inline constexpr std::chrono::milliseconds kWaitSlice{500};

// Asked between slices; true once nobody waits for the answer any more.
using CancelCheck = std::function<bool()>;

// Calls `wait(slice_end)` until it returns anything but kDeadlineExceeded (returned as is),
// `deadline` passes (kDeadlineExceeded from the last slice), or `cancelled()` turns true
// (kCancelled "client went away"). `deadline` may be time_point::max(): no limit.
Status WaitInSlices(std::chrono::steady_clock::time_point deadline, const CancelCheck& cancelled,
                    const std::function<Status(std::chrono::steady_clock::time_point)>& wait);

}  // namespace ckpt
