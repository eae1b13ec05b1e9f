// Unit tests of the CUDA backend's logic that needs no device: the IPC handle cache, the
// event ring, the chunk plan, region names, and the driver loader's errors. They run on
// machines without a GPU (where the loader must report "no CUDA driver/device"). One test
// imports a real allocation from a helper process (cuda_ipc_exporter) and is skipped,
// passing, where no device exists.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <numeric>
#include <thread>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_error.h"
#include "cuda/cuda_importer.h"
#include "cuda/driver_api.h"
#include "cuda/event_ring.h"
#include "cuda/ipc_handle_cache.h"
#include "shm/descriptor_table.h"

using namespace ckpt;
using namespace ckpt::cuda;

namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

IpcHandle HandleOf(std::uint8_t seed) {
  IpcHandle h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<std::uint8_t>(seed * 31 + i);
  return h;
}

// Counts opens and closes; hands out fake base pointers.
class FakeOpener : public IpcOpener {
 public:
  Result<IpcMapping> Open(const IpcHandle& handle, int device) override {
    std::lock_guard lock(mu);
    if (fail_next) {
      fail_next = false;
      return InvalidArgument("fake open failure");
    }
    ++opens;
    ++open_now[handle];
    return IpcMapping{reinterpret_cast<void*>(0x1000 * (opens + 1)), 1 << 20, device};
  }
  Status Close(const IpcMapping&) override {
    std::lock_guard lock(mu);
    ++closes;
    return Status::Ok();
  }
  std::mutex mu;
  int opens = 0;
  int closes = 0;
  bool fail_next = false;
  std::map<IpcHandle, int> open_now;
};

}  // namespace

// ---- driver -----------------------------------------------------------------------------

TEST_CASE("driver loader reports a missing driver or device as a clear error, or loads") {
  const auto& api = Driver();
  if (api.ok()) {
    // A machine with a GPU.
    CHECK(api.value().device_count > 0);
    CHECK(api.value().cuMemGetAddressRange != nullptr);
    CHECK(api.value().cuPointerGetAttribute != nullptr);
  } else {
    INFO(api.status().message());
    CHECK(api.status().code() == StatusCode::kFailedPrecondition);
    CHECK(api.status().message().find("no CUDA driver/device") != std::string::npos);
  }
  // Loaded once: the same object every time.
  CHECK(&Driver() == &api);
}

TEST_CASE("driver loader with a fake probe") {
  DriverProbe probe;
  std::vector<std::string> asked;
  probe.driver_version = [](int* v) {
    *v = 13000;
    return cudaSuccess;
  };
  probe.device_count = [](int* n) {
    *n = 2;
    return cudaSuccess;
  };
  static int dummy;
  probe.entry_point = [&](const char* symbol, void** fn, cudaDriverEntryPointQueryResult* q) {
    asked.emplace_back(symbol);
    *fn = &dummy;
    *q = cudaDriverEntryPointSuccess;
    return cudaSuccess;
  };

  SECTION("all symbols found") {
    auto api = LoadDriverApi(probe);
    REQUIRE(api.ok());
    CHECK(api.value().driver_version == 13000);
    CHECK(api.value().device_count == 2);
    CHECK(reinterpret_cast<void*>(api.value().cuMemGetAddressRange) == &dummy);
    CHECK(std::find(asked.begin(), asked.end(), "cuPointerGetAttribute") != asked.end());
  }
  SECTION("no driver installed") {
    probe.driver_version = [](int* v) {
      *v = 0;
      return cudaSuccess;
    };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().code() == StatusCode::kFailedPrecondition);
    CHECK(api.status().message().find("no CUDA driver/device") == 0);
  }
  SECTION("driver too old for the runtime") {
    probe.device_count = [](int*) { return cudaErrorInsufficientDriver; };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().message().find("no CUDA driver/device") == 0);
    CHECK(api.status().message().find("cudaGetDeviceCount") != std::string::npos);
  }
  SECTION("no device") {
    probe.device_count = [](int* n) {
      *n = 0;
      return cudaSuccess;
    };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().message().find("sees no device") != std::string::npos);
  }
  SECTION("a symbol is missing") {
    probe.entry_point = [&](const char* symbol, void** fn, cudaDriverEntryPointQueryResult* q) {
      bool missing = std::strcmp(symbol, "cuPointerGetAttribute") == 0;
      *fn = missing ? nullptr : &dummy;
      *q = missing ? cudaDriverEntryPointSymbolNotFound : cudaDriverEntryPointSuccess;
      return cudaSuccess;
    };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().message().find("cuPointerGetAttribute") != std::string::npos);
  }
  SECTION("driver older than the requested ABI") {
    probe.entry_point = [&](const char*, void** fn, cudaDriverEntryPointQueryResult* q) {
      *fn = nullptr;
      *q = cudaDriverEntryPointVersionNotSufficent;
      return cudaSuccess;
    };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().message().find("older than version") != std::string::npos);
  }
}

TEST_CASE("CUDA errors become statuses") {
  CHECK(CudaStatus(cudaSuccess, "x").ok());
  Status s = CudaStatus(cudaErrorNoDevice, "cudaSetDevice");
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find("no CUDA driver/device: cudaSetDevice: cudaErrorNoDevice") == 0);
  CHECK(CudaStatus(cudaErrorMemoryAllocation, "m").code() == StatusCode::kResourceExhausted);
  CHECK(CudaStatus(cudaErrorLaunchFailure, "k").code() == StatusCode::kInternal);
}

TEST_CASE("importing a CUDA region without a driver fails cleanly") {
  if (Driver().ok())
    SUCCEED("a CUDA device is present; the GPU tests cover import");
  else {
    auto cache = std::make_shared<IpcHandleCache>(std::make_shared<CudaIpcOpener>());
    CudaIpcImporter importer(cache, std::make_shared<CopyStreamPool>(), 4242);
    CudaRegionRef ref;
    ref.handle = HandleOf(1);
    auto region = importer.Import(FormatCudaRegionName(ref), 1000, 16);
    REQUIRE_FALSE(region.ok());
    CHECK(region.status().message().find("no CUDA driver/device") != std::string::npos);
    CHECK(cache->size() == 0);
    // Malformed names are refused before any CUDA call.
    auto bad = importer.Import("cuda:xyz", 1000, 16);
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  }
}

namespace {

// A child process running cuda_ipc_exporter, with pipes to its stdin and stdout.
struct Exporter {
  pid_t pid = -1;
  FILE* out = nullptr;  // its stdout
  int in = -1;          // its stdin

  bool Start(std::size_t bytes) {
    int to_child[2], from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return false;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    std::string size = std::to_string(bytes);
    char* argv[] = {const_cast<char*>(CUDA_IPC_EXPORTER_BINARY), size.data(), nullptr};
    int rc = posix_spawn(&pid, CUDA_IPC_EXPORTER_BINARY, &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(to_child[0]);
    ::close(from_child[1]);
    in = to_child[1];
    out = ::fdopen(from_child[0], "r");
    return rc == 0 && out != nullptr;
  }
  std::string ReadLine() {
    char buf[512];
    if (out == nullptr || std::fgets(buf, sizeof buf, out) == nullptr) return {};
    std::string line(buf);
    if (!line.empty() && line.back() == '\n') line.pop_back();
    return line;
  }
  ~Exporter() {
    if (in >= 0) ::close(in);
    if (out != nullptr) std::fclose(out);
    if (pid > 0) ::waitpid(pid, nullptr, 0);
  }
};

}  // namespace

TEST_CASE("CUDA IPC import reads and writes a peer's allocation (needs a GPU)") {
  if (!Driver().ok()) {
    SUCCEED("skipped: " + Driver().status().message());
    return;
  }
  constexpr std::size_t kBytes = 24 * kMiB + 123;
  Exporter exporter;
  REQUIRE(exporter.Start(kBytes));
  const std::string name = exporter.ReadLine();
  INFO("exporter said: " << name);
  REQUIRE(IsCudaRegionName(name));

  auto opener = std::make_shared<CudaIpcOpener>();
  auto cache = std::make_shared<IpcHandleCache>(opener);
  auto streams = std::make_shared<CopyStreamPool>();
  CudaIpcImporter importer(cache, streams, exporter.pid);
  {
    auto region = importer.Import(name, ::getuid(), kBytes);
    REQUIRE(region.ok());
    auto again = importer.Import(name, ::getuid(), kBytes);  // same handle: opened once
    REQUIRE(again.ok());
    CHECK(cache->size() == 1);
    CHECK(cache->references(exporter.pid, ParseCudaRegionName(name).value().handle) == 2);
    auto size = region.value()->CurrentSize();
    REQUIRE(size.ok());
    CHECK(size.value() >= kBytes);
    CHECK_FALSE(importer.Import(name, ::getuid(), size.value() + 1).ok());

    std::vector<unsigned char> host(kBytes);
    REQUIRE(region.value()->ReadAt(0, host.data(), kBytes).ok());
    std::size_t bad = kBytes;
    for (std::size_t i = 0; i < kBytes && bad == kBytes; ++i) {
      if (host[i] != static_cast<unsigned char>((i * 7 + 3) & 0xff)) bad = i;
    }
    CHECK(bad == kBytes);
    unsigned char piece[100];
    REQUIRE(again.value()->ReadAt(kMiB + 5, piece, sizeof piece).ok());
    CHECK(piece[0] == static_cast<unsigned char>(((kMiB + 5) * 7 + 3) & 0xff));
    auto beyond = region.value()->ReadAt(size.value() - 10, piece, 20);
    REQUIRE_FALSE(beyond.ok());
    CHECK(beyond.code() == StatusCode::kFailedPrecondition);

    for (std::size_t i = 0; i < kBytes / 2; ++i) host[i] = static_cast<unsigned char>((i * 13 + 1) & 0xff);
    REQUIRE(region.value()->WriteAt(0, host.data(), kBytes / 2).ok());
  }
  CHECK(cache->size() == 0);  // both registrations gone: the handle is closed
  REQUIRE(::write(exporter.in, "check\n", 6) == 6);
  CHECK(exporter.ReadLine() == "ok");
}

// ---- names ------------------------------------------------------------------------------

TEST_CASE("CUDA region names round-trip and fit the descriptor table") {
  CudaRegionRef ref;
  for (std::size_t i = 0; i < 16; ++i) ref.device.bytes[i] = static_cast<std::uint8_t>(0xa0 + i);
  ref.handle = HandleOf(7);
  std::string name = FormatCudaRegionName(ref);
  CHECK(IsCudaRegionName(name));
  CHECK(name.size() == 5 + 32 + 1 + 128);
  CHECK(name.size() <= kMaxRegionNameBytes);  // fits the descriptor table
  auto parsed = ParseCudaRegionName(name);
  REQUIRE(parsed.ok());
  CHECK(parsed.value().device == ref.device);
  CHECK(parsed.value().handle == ref.handle);

  CHECK(ref.device.Pretty() == "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf");
  auto pretty = DeviceUuid::Parse(ref.device.Pretty());
  REQUIRE(pretty.ok());
  CHECK(pretty.value() == ref.device);

  CHECK_FALSE(IsCudaRegionName("/ckpt-shm"));
  CHECK_FALSE(ParseCudaRegionName("/ckpt-shm").ok());
  CHECK_FALSE(ParseCudaRegionName("cuda:" + ref.device.Hex()).ok());
  CHECK_FALSE(ParseCudaRegionName("cuda:" + ref.device.Hex() + ":" + std::string(127, 'a')).ok());
  CHECK_FALSE(ParseCudaRegionName("cuda:" + ref.device.Hex() + ":" + std::string(128, 'g')).ok());
  CHECK_FALSE(ParseCudaRegionName("cuda:GPU-a0a1a2a3a4a5-a6a7-a8a9-aaabacadaeaf:" + ref.handle.Hex()).ok());
  CHECK_FALSE(DeviceUuid::Parse("GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaX").ok());
}

// ---- IPC handle cache -------------------------------------------------------------------

TEST_CASE("IPC handle cache opens each (pid, handle) once and closes it with the last registration") {
  auto opener = std::make_shared<FakeOpener>();
  IpcHandleCache cache(opener);
  const IpcHandle a = HandleOf(1), b = HandleOf(2);

  auto r1 = cache.Register(100, a, 0);
  auto r2 = cache.Register(100, a, 0);
  auto r3 = cache.Register(100, b, 0);
  auto r4 = cache.Register(200, a, 1);  // same bytes from another process: its own entry
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  REQUIRE(r3.ok());
  REQUIRE(r4.ok());
  CHECK(opener->opens == 3);
  CHECK(cache.size() == 3);
  CHECK(cache.references(100, a) == 2);
  CHECK(r1.value().mapping().base == r2.value().mapping().base);
  CHECK(r1.value().mapping().base != r3.value().mapping().base);
  CHECK(r4.value().mapping().device == 1);

  r1.value().Reset();
  CHECK(opener->closes == 0);
  CHECK(cache.references(100, a) == 1);
  r2.value().Reset();
  CHECK(opener->closes == 1);
  CHECK(cache.references(100, a) == 0);
  CHECK(cache.size() == 2);

  // Opened again after it was closed.
  auto r5 = cache.Register(100, a, 0);
  REQUIRE(r5.ok());
  CHECK(opener->opens == 4);
}

TEST_CASE("IPC handle cache releases a client that exited, but not under a copy in flight") {
  auto opener = std::make_shared<FakeOpener>();
  IpcHandleCache cache(opener);
  auto r1 = cache.Register(100, HandleOf(1), 0);
  auto r2 = cache.Register(100, HandleOf(2), 0);
  auto r3 = cache.Register(100, HandleOf(2), 0);
  auto other = cache.Register(101, HandleOf(1), 0);
  REQUIRE((r1.ok() && r2.ok() && r3.ok() && other.ok()));
  CHECK(opener->opens == 3);

  // A copy in flight holds the mapping of handle 1.
  std::shared_ptr<const IpcMapping> in_flight = r1.value().Lock();
  REQUIRE(in_flight);

  CHECK(cache.ReleaseClient(100) == 2);
  CHECK(cache.size() == 1);
  CHECK(opener->closes == 1);  // handle 2 closed at once; handle 1 waits for the copy
  CHECK_FALSE(r2.value().Lock());
  CHECK(r1.value().mapping().size == in_flight->size);  // the values stay readable
  in_flight.reset();
  CHECK(opener->closes == 2);
  CHECK_FALSE(r1.value().Lock());
  // Stale registrations of the released client do not disturb anything.
  r1.value().Reset();
  r2.value().Reset();
  r3.value().Reset();
  CHECK(opener->closes == 2);
  CHECK(cache.size() == 1);
  CHECK(cache.references(101, HandleOf(1)) == 1);
  CHECK(other.value().Lock());
  CHECK(cache.ReleaseClient(100) == 0);
}

TEST_CASE("IPC handle cache errors and lifetimes") {
  auto opener = std::make_shared<FakeOpener>();
  SECTION("a failed open caches nothing") {
    IpcHandleCache cache(opener);
    opener->fail_next = true;
    auto r = cache.Register(100, HandleOf(1), 0);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find("pid 100") != std::string::npos);
    CHECK(cache.size() == 0);
    CHECK(cache.Register(100, HandleOf(1), 0).ok());
  }
  SECTION("the same handle on two devices is refused") {
    IpcHandleCache cache(opener);
    auto r = cache.Register(100, HandleOf(1), 0);
    REQUIRE(r.ok());
    auto r2 = cache.Register(100, HandleOf(1), 1);
    REQUIRE_FALSE(r2.ok());
    CHECK(r2.status().code() == StatusCode::kInvalidArgument);
    CHECK(cache.references(100, HandleOf(1)) == 1);
  }
  SECTION("registrations may outlive the cache") {
    Result<IpcHandleCache::Registration> r = Status();
    {
      IpcHandleCache cache(opener);
      r = cache.Register(100, HandleOf(1), 0);
      REQUIRE(r.ok());
    }
    CHECK(opener->closes == 1);  // the cache's entries went with it
    CHECK_FALSE(r.value().Lock());
    r.value().Reset();
    CHECK(opener->closes == 1);
  }
  SECTION("destroying the cache closes unused mappings") {
    {
      IpcHandleCache cache(opener);
      auto r = cache.Register(100, HandleOf(1), 0);
      auto r2 = cache.Register(100, HandleOf(2), 0);
      r2.value().Reset();
    }
    CHECK(opener->opens == 2);
    CHECK(opener->closes == 2);
  }
  SECTION("moving a registration moves its reference") {
    IpcHandleCache cache(opener);
    auto r = cache.Register(100, HandleOf(1), 0);
    IpcHandleCache::Registration moved = std::move(r.value());
    CHECK_FALSE(r.value().valid());
    CHECK(moved.valid());
    CHECK(cache.references(100, HandleOf(1)) == 1);
    moved = IpcHandleCache::Registration();
    CHECK(opener->closes == 1);
  }
}

TEST_CASE("IPC handle cache under concurrent registrations") {
  auto opener = std::make_shared<FakeOpener>();
  IpcHandleCache cache(opener);
  std::atomic<int> failures{0};  // Catch2 assertions are not thread-safe
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<IpcHandleCache::Registration> held;
      for (int i = 0; i < 200; ++i) {
        auto r = cache.Register(100 + (i % 3), HandleOf(static_cast<std::uint8_t>(i % 5)), 0);
        if (!r.ok()) {
          ++failures;
          continue;
        }
        // Lock() may be null here: another thread may have released the client already.
        if (auto pinned = r.value().Lock(); pinned && pinned->size == 0) ++failures;
        held.push_back(std::move(r).value());
        if ((i + t) % 7 == 0) cache.ReleaseClient(100 + (i % 3));
        if (held.size() > 4) held.erase(held.begin());
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  CHECK(cache.size() == 0);
  CHECK(opener->opens == opener->closes);
}

TEST_CASE("IPC handles as hex") {
  IpcHandle h = HandleOf(9);
  auto back = IpcHandle::FromHex(h.Hex());
  REQUIRE(back.ok());
  CHECK(back.value() == h);
  CHECK_FALSE(IpcHandle::FromHex("abc").ok());
}

// ---- event ring -------------------------------------------------------------------------

TEST_CASE("event slots are assigned round-robin and reused only when captured and acknowledged") {
  auto made = EventSlotRing::Create(3);
  REQUIRE(made.ok());
  EventSlotRing& ring = *made.value();
  CHECK(ring.Assign(10).value() == 0);
  CHECK(ring.Assign(11).value() == 1);
  CHECK(ring.Assign(12).value() == 2);
  CHECK(ring.SlotOf(11).value() == 1);

  // Slot 0 still holds version 10.
  CHECK(ring.BlockingVersion() == std::optional<std::uint64_t>(10));
  auto busy = ring.Assign(13);
  REQUIRE_FALSE(busy.ok());
  CHECK(busy.status().code() == StatusCode::kResourceExhausted);
  CHECK(busy.status().message().find("captured") != std::string::npos);

  // Captured but not acknowledged: a peer may still wait on it.
  REQUIRE(ring.MarkCaptured(10).ok());
  CHECK_FALSE(ring.Reusable(0));
  busy = ring.Assign(13);
  REQUIRE_FALSE(busy.ok());
  CHECK(busy.status().message().find("acknowledged") != std::string::npos);

  // Acknowledged but not captured: the daemon may still wait on it.
  REQUIRE(ring.Acknowledge(11).ok());
  CHECK_FALSE(ring.Reusable(1));

  REQUIRE(ring.Acknowledge(10).ok());
  CHECK(ring.Reusable(0));
  CHECK_FALSE(ring.BlockingVersion().has_value());
  CHECK(ring.Assign(13).value() == 0);
  CHECK_FALSE(ring.SlotOf(10).ok());  // its slot was reused
  CHECK(ring.next_slot() == 1);

  // Moving past acknowledges all older versions at once.
  REQUIRE(ring.MarkCaptured(11).ok());
  REQUIRE(ring.MarkCaptured(12).ok());
  ring.AcknowledgeThrough(12);
  CHECK(ring.Assign(20).value() == 1);
  CHECK(ring.Assign(21).value() == 2);
  CHECK_FALSE(ring.Reusable(0));  // 13: neither captured nor acknowledged
}

TEST_CASE("event slot ring refuses bad input") {
  CHECK_FALSE(EventSlotRing::Create(0).ok());
  CHECK_FALSE(EventSlotRing::Create(5000).ok());
  auto ring = std::move(EventSlotRing::Create(2)).value();
  REQUIRE(ring->Assign(5).ok());
  auto again = ring->Assign(5);
  REQUIRE_FALSE(again.ok());
  CHECK(again.status().code() == StatusCode::kFailedPrecondition);
  CHECK_FALSE(ring->Assign(4).ok());
  CHECK(ring->MarkCaptured(99).code() == StatusCode::kNotFound);
  CHECK(ring->Acknowledge(99).code() == StatusCode::kNotFound);
  CHECK_FALSE(ring->Reusable(7));
}

namespace {

struct EventLog {
  std::vector<std::pair<int, void*>> records;  // (event id, stream)
  std::vector<std::pair<int, void*>> waits;
};

class FakeEvent : public IpcEvent {
 public:
  FakeEvent(int id, EventLog* log) : id_(id), log_(log) { handle_ = HandleOf(static_cast<std::uint8_t>(id)); }
  Status Record(void* stream) override {
    log_->records.emplace_back(id_, stream);
    return Status::Ok();
  }
  Status StreamWait(void* stream) override {
    log_->waits.emplace_back(id_, stream);
    return Status::Ok();
  }
  Status Synchronize() override { return Status::Ok(); }
  const IpcHandle& handle() const override { return handle_; }

 private:
  int id_;
  EventLog* log_;
  IpcHandle handle_;
};

class FakeEventFactory : public IpcEventFactory {
 public:
  explicit FakeEventFactory(EventLog* log) : log_(log) {}
  Result<std::unique_ptr<IpcEvent>> Create() override {
    if (fail_after >= 0 && created >= fail_after) return Internal("fake create failure");
    return std::unique_ptr<IpcEvent>(new FakeEvent(created++, log_));
  }
  Result<std::unique_ptr<IpcEvent>> Open(const IpcHandle& handle) override {
    return std::unique_ptr<IpcEvent>(new FakeEvent(100 + handle.bytes[0], log_));
  }
  int created = 0;
  int fail_after = -1;

 private:
  EventLog* log_;
};

}  // namespace

TEST_CASE("event ring never re-records an event a peer may still wait on") {
  EventLog log;
  FakeEventFactory factory(&log);
  auto made = EventRing::Create(2, factory);
  REQUIRE(made.ok());
  EventRing& ring = *made.value();
  CHECK(ring.handles().size() == 2);
  void* stream = reinterpret_cast<void*>(0x51);

  CHECK(ring.RecordVersion(1, stream).value() == 0);
  CHECK(ring.RecordVersion(2, stream).value() == 1);
  // Slot 0 (version 1) is not released: nothing is recorded.
  CHECK_FALSE(ring.RecordVersion(3, stream).ok());
  CHECK(log.records.size() == 2);

  REQUIRE(ring.WaitVersion(2, stream).ok());
  CHECK(log.waits == std::vector<std::pair<int, void*>>{{1, stream}});
  CHECK_FALSE(ring.WaitVersion(7, stream).ok());

  REQUIRE(ring.slots().MarkCaptured(1).ok());
  REQUIRE(ring.slots().Acknowledge(1).ok());
  CHECK(ring.RecordVersion(3, stream).value() == 0);
  REQUIRE(log.records.size() == 3);
  CHECK(log.records.back().first == 0);  // the event of slot 0 again
}

TEST_CASE("event ring opens a peer's events and fails cleanly") {
  EventLog log;
  FakeEventFactory factory(&log);
  auto opened = EventRing::Open({HandleOf(1), HandleOf(2), HandleOf(3)}, factory);
  REQUIRE(opened.ok());
  CHECK(opened.value()->slots().slots() == 3);
  CHECK_FALSE(EventRing::Open({}, factory).ok());

  factory.fail_after = 1;
  auto failed = EventRing::Create(4, factory);
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.status().message().find("create event 1") != std::string::npos);
}

// ---- session events (the daemon's side of the rings) ------------------------------------

namespace {

// A copy lane that only has an identity and remembers what it was ordered after.
class RecordingLane : public ckpt::CopyLane {
 public:
  bool synchronous() const override { return false; }
  void* native() const override { return const_cast<RecordingLane*>(this); }
  Status CopyOut(const ckpt::ImportedRegion&, std::uint64_t, void*, std::size_t) override {
    return Status::Ok();
  }
  Status CopyIn(const ckpt::ImportedRegion&, std::uint64_t, const void*, std::size_t) override {
    return Status::Ok();
  }
  Result<std::uint64_t> EndChunk() override { return std::uint64_t{1}; }
  Status WaitChunk(std::uint64_t, const std::function<bool()>&) override { return Status::Ok(); }
  bool Idle() override { return true; }
  Status After(CopyLane& other) override {
    after.push_back(&other);
    return Status::Ok();
  }
  std::vector<CopyLane*> after;
};

std::vector<std::string> TrainerHandles(int n) {
  std::vector<std::string> out;
  for (int i = 1; i <= n; ++i) {
    IpcHandle h = HandleOf(static_cast<std::uint8_t>(i));
    out.emplace_back(reinterpret_cast<const char*>(h.bytes.data()), h.bytes.size());
  }
  return out;
}

}  // namespace

TEST_CASE("session events gate every lane on the trainer's slot and signal after all lanes") {
  EventLog log;
  auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 3, TrainerHandles(4), 3);
  REQUIRE(made.ok());
  SessionEvents& events = *made.value();
  CHECK(events.device() == 3);
  REQUIRE(events.daemon_handles().size() == 3);
  for (const auto& h : events.daemon_handles()) CHECK(h.size() == IpcHandle::kBytes);

  auto sync = events.Begin(10, 2);
  REQUIRE(sync.ok());
  CHECK(sync.value()->daemon_slot() == 0);
  RecordingLane a, b;
  REQUIRE(sync.value()->Gate(a).ok());
  REQUIRE(sync.value()->Gate(b).ok());
  // Trainer slot 2 is the opened event of the third handle (fake id 100 + its first byte).
  const int third = 100 + HandleOf(3).bytes[0];
  CHECK(log.waits == std::vector<std::pair<int, void*>>{{third, &a}, {third, &b}});
  CHECK(log.records.empty());
  REQUIRE(sync.value()->Signal({&a, &b}).ok());
  CHECK(a.after == std::vector<ckpt::CopyLane*>{&b});
  CHECK(log.records == std::vector<std::pair<int, void*>>{{0, &a}});  // daemon slot 0 on lane a
  CHECK_FALSE(sync.value()->Signal({}).ok());
}

TEST_CASE("session events reuse a daemon slot only when released and superseded, across rollbacks") {
  EventLog log;
  auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 2);
  REQUIRE(made.ok());
  SessionEvents& events = *made.value();
  auto v1 = events.Begin(1, 0);
  auto v2 = events.Begin(2, 1);
  REQUIRE(v1.ok());
  REQUIRE(v2.ok());
  CHECK(v2.value()->daemon_slot() == 1);
  // Slot 0 still belongs to version 1, whose copies are not done being queued.
  auto blocked = events.Begin(3, 0);
  REQUIRE_FALSE(blocked.ok());
  CHECK(blocked.status().code() == StatusCode::kResourceExhausted);
  CHECK(blocked.status().message().find("version 3") != std::string::npos);
  v1.value()->Release();
  v1.value()->Release();  // idempotent
  auto v3 = events.Begin(3, 0);
  REQUIRE(v3.ok());
  CHECK(v3.value()->daemon_slot() == 0);
  // A rollback repeats version numbers; the ring goes by order of snapshots, not numbers.
  v2.value().reset();  // destroying a sync releases it
  auto again = events.Begin(2, 1);
  REQUIRE(again.ok());
  CHECK(again.value()->daemon_slot() == 1);
}

TEST_CASE("session events refuse bad trainer slots and handles") {
  EventLog log;
  auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 4);
  REQUIRE(made.ok());
  auto bad = made.value()->Begin(1, 2);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("outside its ring of 2") != std::string::npos);
  CHECK(made.value()->Begin(1, 1).ok());  // a refused Begin took no daemon slot

  CHECK_FALSE(MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, {}, 4).ok());
  auto short_handle = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, {"abc"}, 4);
  REQUIRE_FALSE(short_handle.ok());
  CHECK(short_handle.status().message().find("3 bytes, not 64") != std::string::npos);
}

TEST_CASE("the CUDA backend reports a machine without a GPU, or describes its devices") {
  auto backend = MakeCudaBackend();
  if (!backend.ok()) {
    CHECK(backend.status().message().find(kNoDriverPhrase) != std::string::npos);
    return;
  }
  CHECK(backend.value()->Describe().find("device") != std::string::npos);
  CHECK(backend.value()->Owns("cuda:00:11"));
  CHECK_FALSE(backend.value()->Owns("/ckpt-shm"));
}
