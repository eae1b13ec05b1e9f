#include "support/fake_device.h"

#include <cstring>

namespace ckpt::test {

Result<DeviceSpan> FakeDeviceRegion::DeviceAt(std::uint64_t offset, std::size_t len) const {
  if (closed) return FailedPrecondition("CUDA region " + name() + " is closed: its client was released");
  if (offset + len > bytes().size()) return FailedPrecondition("region " + name() + " is too small");
  return DeviceSpan{const_cast<char*>(bytes().data()) + offset, keep_};
}

void FakeDeviceRegion::Overwrite(const std::string& data) {
  std::memcpy(const_cast<char*>(bytes().data()), data.data(), data.size());
}

void FakeDevice::PokeAll() {
  std::lock_guard lock(mu);
  for (AsyncLane* l : lanes) l->Poke();
}

void FakeDevice::WaitAllIdle() {
  std::set<AsyncLane*> now;
  {
    std::lock_guard lock(mu);
    now = lanes;  // no copy runs meanwhile: the lanes stay alive
  }
  for (AsyncLane* l : now) l->WaitDone(l->queued());
}

AsyncLane::AsyncLane(FakeDevice& device) : device_(device), worker_([this] { Run(); }) { device_.Add(this); }

AsyncLane::~AsyncLane() {
  device_.Remove(this);
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

Status AsyncLane::CopyOut(const ImportedRegion& region, std::uint64_t offset, void* dst, std::size_t len) {
  if (region.device() < 0) return region.ReadAt(offset, dst, len);
  auto span = region.DeviceAt(offset, len);
  if (!span.ok()) return span.status();
  device_.bytes_queued += len;
  ++device_.copies_out;
  device_.first_copy_queued.Open();
  Enqueue([this, dst, len, span = std::move(span).value()] {
    std::memcpy(dst, span.ptr, len);
    device_.bytes_done += len;
  });
  return Status::Ok();
}

Status AsyncLane::CopyIn(const ImportedRegion& region, std::uint64_t offset, const void* src,
                         std::size_t len) {
  if (region.device() < 0) return region.WriteAt(offset, src, len);
  auto span = region.DeviceAt(offset, len);
  if (!span.ok()) return span.status();
  ++device_.copies_in;
  Enqueue([this, src, len, span = std::move(span).value()] {
    std::memcpy(span.ptr, src, len);
    device_.bytes_in_done += len;
  });
  return Status::Ok();
}

Result<std::uint64_t> AsyncLane::EndChunk() {
  {
    std::lock_guard dlock(device_.mu);
    ++device_.chunks_per_lane[this];
  }
  std::lock_guard lock(mu_);
  ticket_end_[++tickets_] = queued_;
  return tickets_;
}

Status AsyncLane::WaitChunk(std::uint64_t ticket, const std::function<bool()>& give_up) {
  std::unique_lock lock(mu_);
  const std::uint64_t end = ticket_end_.at(ticket);
  // Woken by the worker, or by Poke() when the shard may have been given up.
  cv_.wait(lock, [&] { return done_ >= end || give_up(); });
  if (done_ >= end) return Status::Ok();
  return FailedPrecondition("device-to-host copies abandoned before they ran");
}

bool AsyncLane::Idle() {
  std::lock_guard lock(mu_);
  return done_ == queued_;
}

Status AsyncLane::After(CopyLane& other) {
  auto* o = static_cast<AsyncLane*>(other.native());
  if (o == this) return Status::Ok();
  const std::uint64_t until = o->queued();
  Enqueue([o, until] { o->WaitDone(until); });
  return Status::Ok();
}

void AsyncLane::Enqueue(std::function<void()> op) {
  {
    std::lock_guard lock(mu_);
    ops_.push_back(std::move(op));
    ++queued_;
  }
  cv_.notify_all();
}

std::uint64_t AsyncLane::queued() {
  std::lock_guard lock(mu_);
  return queued_;
}

void AsyncLane::WaitDone(std::uint64_t n) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_ >= n; });
}

void AsyncLane::Run() {
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
      if (ops_.empty()) return;
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    op();
    {
      std::lock_guard lock(mu_);
      ++done_;
    }
    cv_.notify_all();
  }
}

Result<std::vector<std::unique_ptr<CopyLane>>> FakeBackend::MakeLanes(int device, std::uint32_t count) {
  if (device != 0) return NotFound("no device " + std::to_string(device));
  std::vector<std::unique_ptr<CopyLane>> lanes;
  for (std::uint32_t i = 0; i < count; ++i) lanes.push_back(std::make_unique<AsyncLane>(fake));
  fake.lanes_made += static_cast<int>(count);
  return lanes;
}

}  // namespace ckpt::test
