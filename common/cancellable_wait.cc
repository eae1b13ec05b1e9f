#include "common/cancellable_wait.h"

#include <algorithm>

namespace ckpt {

Status WaitInSlices(std::chrono::steady_clock::time_point deadline, const CancelCheck& cancelled,
                    const std::function<Status(std::chrono::steady_clock::time_point)>& wait) {
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const auto slice_end = deadline - now > kWaitSlice ? now + kWaitSlice : deadline;
    Status st = wait(slice_end);
    if (st.code() != StatusCode::kDeadlineExceeded || slice_end == deadline) return st;
    if (cancelled && cancelled()) return Cancelled("client went away");
  }
}

}  // namespace ckpt
