#include "support/fake_version_sync.h"

namespace ckpt::test {

Status FakeSync::Gate(CopyLane& lane) {
  ++gates;
  gated.Open();
  static_cast<AsyncLane*>(lane.native())->Enqueue([this] { trainer_event.Wait(); });
  return Status::Ok();
}

Status FakeSync::Signal(const std::vector<CopyLane*>& lanes) {
  ++signals;
  bytes_queued_at_signal = device_.bytes_queued.load();
  for (std::size_t i = 1; i < lanes.size(); ++i) lanes[0]->After(*lanes[i]);
  static_cast<AsyncLane*>(lanes[0]->native())->Enqueue([this] {
    bytes_done_at_completion = device_.bytes_done.load();
    completion.Open();
  });
  return Status::Ok();
}

}  // namespace ckpt::test
