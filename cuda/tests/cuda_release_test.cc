// The host-side logic of giving GPU memory back, without a GPU: the DeviceReleaser thread
// (closes and unpins off the caller's thread, put off while a lane is abandoned, a stop that
// never waits for ever), the LaneWatch that says which lanes are abandoned, the IPC handle
// cache closing through it, and which CUDA errors count as sticky.
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "cuda/cuda_error.h"
#include "cuda/device_releaser.h"
#include "cuda/ipc_handle_cache.h"
#include "cuda/lane_watch.h"
#include "support/eventually.h"

using namespace ckpt;
using namespace ckpt::cuda;
using namespace ckpt::test;

namespace {

// A gate a release blocks on until the test opens it (a close stuck behind a stream).
struct Gate {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  void Open() { promise.set_value(); }
};

IpcHandle HandleOf(std::uint8_t seed) {
  IpcHandle h;
  h.bytes.fill(seed);
  return h;
}

// Counts opens and closes; each close first waits for `gate` (when set) and notes its thread.
class BlockingOpener : public IpcOpener {
 public:
  Result<IpcMapping> Open(const IpcHandle& handle, int device) override {
    std::lock_guard lock(mu);
    ++opens;
    return IpcMapping{reinterpret_cast<void*>(std::uintptr_t{handle.bytes[0]} << 12), 1 << 20, device};
  }
  Status Close(const IpcMapping& m) override {
    std::shared_future<void> wait;
    {
      std::lock_guard lock(mu);
      close_thread = std::this_thread::get_id();
      entered.push_back(m.base);
      wait = gate;
    }
    if (wait.valid()) wait.wait();
    std::lock_guard lock(mu);
    ++closes;
    return Status::Ok();
  }
  int Closes() {
    std::lock_guard lock(mu);
    return closes;
  }
  std::size_t Entered() {
    std::lock_guard lock(mu);
    return entered.size();
  }
  std::mutex mu;
  std::shared_future<void> gate;
  int opens = 0, closes = 0;
  std::vector<void*> entered;
  std::thread::id close_thread;
};

auto Soon() { return std::chrono::steady_clock::now() + std::chrono::milliseconds(100); }
auto Later() { return std::chrono::steady_clock::now() + std::chrono::seconds(30); }

}  // namespace

TEST_CASE("releases run in order on the releaser's thread, and posting never waits for one") {
  DeviceReleaser releaser([](int) { return false; });
  Gate gate;
  std::vector<int> order;
  std::mutex mu;
  std::thread::id ran_on;
  releaser.Post(0, [&] {
    gate.future.wait();
    std::lock_guard lock(mu);
    ran_on = std::this_thread::get_id();
    order.push_back(1);
  });
  releaser.Post(1, [&] {
    std::lock_guard lock(mu);
    order.push_back(2);
  });
  // The first is stuck; the caller is not.
  CHECK(releaser.AwaitPosted(Soon()).code() == StatusCode::kDeadlineExceeded);
  CHECK(releaser.counts().run == 0);
  gate.Open();
  REQUIRE(releaser.AwaitPosted(Later()).ok());
  std::lock_guard lock(mu);
  CHECK(order == std::vector<int>{1, 2});
  CHECK(ran_on != std::this_thread::get_id());
  CHECK(releaser.counts().posted == 2);
  CHECK(releaser.counts().run == 2);
}

TEST_CASE("a close stuck in the driver does not hold up releasing other exited trainers") {
  auto opener = std::make_shared<BlockingOpener>();
  Gate gate;
  opener->gate = gate.future;
  auto releaser = std::make_shared<DeviceReleaser>([](int) { return false; });
  IpcHandleCache cache(std::make_shared<ReleasingOpener>(opener, releaser));
  {
    auto a = cache.Register(100, HandleOf(1), 0);
    auto b = cache.Register(200, HandleOf(2), 0);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
  }  // the registrations' last references: two closes posted
  REQUIRE(Eventually([&] { return opener->Entered() == 1; }));
  // What the reaper does for two more trainers that exited: neither call waits.
  REQUIRE(cache.Register(300, HandleOf(3), 0).ok());
  auto held = cache.Register(400, HandleOf(4), 0);
  REQUIRE(held.ok());
  CHECK(cache.ReleaseClient(300) == 0);  // its registration went already
  CHECK(cache.ReleaseClient(400) == 1);
  CHECK(cache.size() == 0);
  CHECK(opener->Closes() == 0);
  CHECK(releaser->AwaitPosted(Soon()).code() == StatusCode::kDeadlineExceeded);
  gate.Open();
  REQUIRE(releaser->AwaitPosted(Later()).ok());
  CHECK(opener->Closes() == 4);
  CHECK(opener->opens == 4);
  CHECK(opener->close_thread != std::this_thread::get_id());
}

TEST_CASE("closes on a device whose lane waits on a dead trainer's event are put off until it drains") {
  auto watch = std::make_shared<LaneWatch>();
  std::atomic<bool> idle{false};
  const LaneWatch::Id lane = watch->Add(0, [&] { return idle.load(); });
  auto gone = std::make_shared<std::atomic<bool>>(false);

  watch->Gated(lane, gone);
  CHECK_FALSE(watch->Abandoned(0));  // a live trainer's event fires
  *gone = true;
  CHECK(watch->Abandoned(0));
  CHECK(watch->Abandoned(-1));
  CHECK_FALSE(watch->Abandoned(1));

  DeviceReleaser releaser([watch](int device) { return watch->Abandoned(device); },
                          std::chrono::milliseconds(5));
  std::atomic<int> closed0{0}, closed1{0};
  releaser.Post(0, [&] { ++closed0; });
  releaser.Post(1, [&] { ++closed1; });
  releaser.Post(-1, [&] { ++closed0; });  // the pool's unpin: any device counts
  Status st = releaser.AwaitPosted(Later());
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message().find("2 close(s) or unpin(s)") != std::string::npos);
  CHECK(closed1 == 1);
  CHECK(closed0 == 0);
  CHECK(releaser.counts().put_off == 2);

  idle = true;  // the stuck copies ran after all (or the stream was torn down)
  REQUIRE(Eventually([&] { return closed0 == 2; }, std::chrono::seconds(10)));
  CHECK(releaser.AwaitPosted(Later()).ok());

  // An event seen to fire clears the lane, and a removed lane counts for nothing.
  idle = false;
  CHECK(watch->Abandoned(0));
  watch->Flowing(lane);
  CHECK_FALSE(watch->Abandoned(0));
  watch->Gated(lane, gone);
  watch->Remove(lane);
  CHECK_FALSE(watch->Abandoned(0));
}

TEST_CASE("stopping the releaser never waits past its deadline, and drops what is put off") {
  auto releaser = std::make_unique<DeviceReleaser>([](int device) { return device == 7; });
  Gate gate;
  std::atomic<bool> stuck_ran{false}, put_off_ran{false}, after_ran{false};
  releaser->Post(7, [&] { put_off_ran = true; });
  releaser->Post(0, [&, f = gate.future] {
    f.wait();
    stuck_ran = true;
  });
  releaser->Post(0, [&] { after_ran = true; });
  const auto t0 = std::chrono::steady_clock::now();
  releaser->Stop(std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  releaser->Post(0, [&] { after_ran = true; });  // after Stop: dropped
  releaser.reset();                              // its thread is left behind, holding its state
  gate.Open();
  // The thread left behind runs nothing more once it returns.
  std::this_thread::yield();
  CHECK_FALSE(put_off_ran);
  CHECK(Eventually([&] { return stuck_ran.load(); }, std::chrono::seconds(10)));
  CHECK_FALSE(after_ran);
}

TEST_CASE("sticky CUDA errors are told from the others, and reach the process's handler") {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction,
                        cudaErrorMisalignedAddress, cudaErrorInvalidPc, cudaErrorHardwareStackError,
                        cudaErrorAssert, cudaErrorECCUncorrectable, cudaErrorLaunchTimeout}) {
    INFO(::cudaGetErrorName(e));
    CHECK(IsStickyContextError(e));
  }
  for (cudaError_t e : {cudaSuccess, cudaErrorNotReady, cudaErrorInvalidValue, cudaErrorMemoryAllocation,
                        cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorInvalidResourceHandle,
                        cudaErrorPeerAccessAlreadyEnabled, cudaErrorMapBufferObjectFailed}) {
    INFO(::cudaGetErrorName(e));
    CHECK_FALSE(IsStickyContextError(e));
  }
  std::vector<std::string> seen;
  SetStickyErrorHandler([&](const std::string& text) { seen.push_back(text); });
  CHECK(CudaStatus(cudaErrorInvalidValue, "cudaMemcpyAsync").code() == StatusCode::kInvalidArgument);
  CHECK(seen.empty());
  Status st = CudaStatus(cudaErrorIllegalAddress, "cudaEventQuery");
  SetStickyErrorHandler(nullptr);
  CHECK_FALSE(st.ok());
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].find("cudaEventQuery: cudaErrorIllegalAddress") != std::string::npos);
  CHECK(CudaStatus(cudaErrorIllegalAddress, "no handler now").code() == StatusCode::kInternal);
  CHECK(seen.size() == 1);
}
