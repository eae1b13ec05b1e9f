// Unit tests of the CUDA backend's logic that needs no device: the IPC handle cache, the
// event ring, the chunk plan, region names, and the driver loader's errors. They run on
// machines without a GPU (where the loader must report "no CUDA driver/device"). One test
// imports a real allocation from a helper process (cuda_ipc_exporter) and is skipped,
// passing, where no device exists.
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_error.h"
#include "cuda/cuda_importer.h"
#include "cuda/driver_api.h"
#include "cuda/event_ring.h"
#include "cuda/ipc_handle_cache.h"
#include "cuda/pid_namespace.h"
#include "cuda/release_word_writer.h"
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
    // An R550 node: its driver supports CUDA 12.4, the binary's static runtime is 13.0.
    probe.driver_version = [](int* v) {
      *v = 12040;
      return cudaSuccess;
    };
    probe.runtime_version = [](int* v) {
      *v = 13000;
      return cudaSuccess;
    };
    probe.device_count = [](int*) { return cudaErrorInsufficientDriver; };
    auto api = LoadDriverApi(probe);
    REQUIRE_FALSE(api.ok());
    const std::string& m = api.status().message();
    INFO(m);
    CHECK(api.status().code() == StatusCode::kFailedPrecondition);
    CHECK(m.find("no CUDA driver/device") == 0);
    CHECK(m.find("the NVIDIA driver supports CUDA 12.4 (cudaDriverGetVersion: 12040)") != std::string::npos);
    CHECK(m.find("CUDA 13.0 runtime, which needs NVIDIA driver R580 or newer") != std::string::npos);
    CHECK(m.find("upgrade the driver") != std::string::npos);
    CHECK(m.find("cudaGetDeviceCount: cudaErrorInsufficientDriver") != std::string::npos);
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

TEST_CASE("the driver a runtime needs, and the message for one too old") {
  CHECK(MinimumDriverFor(13000).find("R580 or newer") == 0);
  CHECK(MinimumDriverFor(13020).find("R580 or newer") == 0);  // minor-version compatibility
  CHECK(MinimumDriverFor(12080).find("R525 or newer") == 0);
  CHECK(MinimumDriverFor(14000) == "one that supports CUDA 14.0");
  CHECK(DriverTooOldMessage(12080, 13000) ==
        "the NVIDIA driver supports CUDA 12.8 (cudaDriverGetVersion: 12080), older than this binary's CUDA "
        "13.0 runtime, which needs NVIDIA driver R580 or newer (580.65.06 or later on Linux): upgrade the "
        "driver on this node (see README, GPU requirements)");
  CHECK(DriverTooOldMessage(0, 13000).find("the NVIDIA driver's CUDA version is unknown, older than") == 0);
  // The runtime these binaries link is the one they were compiled against (the CUDA 13
  // toolkit's, or CKPT_CUDA_RUNTIME_ROOT's), so the message names the right minimum.
  int runtime = 0;
  REQUIRE(cudaRuntimeGetVersion(&runtime) == cudaSuccess);
  CHECK(runtime == CUDART_VERSION);
  CHECK(MinimumDriverFor(runtime).find(runtime / 1000 == 12 ? "R525" : "R580") == 0);
}

TEST_CASE("a failed CUDA IPC open names a trainer in another PID namespace") {
  const Result<std::string> host = std::string("pid:[4026531836]");
  const Result<std::string> container = std::string("pid:[4026532178]");
  CHECK(PidNamespaceNote(42, host, host).empty());
  const std::string other = PidNamespaceNote(42, container, host);
  CHECK(other.find("the trainer (pid 42) runs in PID namespace pid:[4026532178], ckptd in pid:[4026531836]: "
                   "legacy CUDA IPC does not work across PID namespaces") == 0);
  CHECK(other.find("hostPID: true") != std::string::npos);
  const std::string unreadable =
      PidNamespaceNote(42, Internal("readlink /proc/42/ns/pid: Permission denied"), host);
  CHECK(unreadable.find("if the trainer (pid 42) runs in another PID namespace than ckptd (pid:[4026531836]; "
                        "readlink /proc/42/ns/pid: Permission denied), that is the cause") == 0);
  CHECK(PidNamespaceNote(0, Internal("no pid"), host).find("outside ckptd's (pid:[4026531836])") !=
        std::string::npos);

  // The real reads: this process, and a child in a PID namespace of its own.
  auto self = PidNamespaceOf(0);
  REQUIRE(self.ok());
  CHECK(self.value().rfind("pid:[", 0) == 0);
  CHECK(PidNamespaceNoteFor(getpid()).empty());
  int ready[2], hold[2];
  REQUIRE(pipe(ready) == 0);
  REQUIRE(pipe(hold) == 0);
  const pid_t middle = fork();
  REQUIRE(middle >= 0);
  if (middle == 0) {
    // The child enters new user and PID namespaces; its own child is the first process of
    // the new PID namespace and waits until the test closes `hold`.
    close(ready[0]);
    close(hold[1]);
    pid_t inner = -1;
    if (unshare(CLONE_NEWUSER | CLONE_NEWPID) == 0) {
      inner = fork();
      if (inner == 0) {
        char c;
        (void)!read(hold[0], &c, 1);
        _exit(0);
      }
    }
    (void)!write(ready[1], &inner, sizeof inner);
    if (inner > 0) waitpid(inner, nullptr, 0);
    _exit(0);
  }
  close(ready[1]);
  close(hold[0]);
  pid_t inner = -1;
  REQUIRE(read(ready[0], &inner, sizeof inner) == static_cast<ssize_t>(sizeof inner));
  close(ready[0]);
  if (inner <= 0) {
    WARN("unshare(CLONE_NEWUSER | CLONE_NEWPID) is not allowed here; the real read is not checked");
  } else {
    auto theirs = PidNamespaceOf(inner);
    REQUIRE(theirs.ok());
    CHECK(theirs.value() != self.value());
    const std::string note = PidNamespaceNoteFor(inner);
    INFO(note);
    CHECK(note.find("the trainer (pid " + std::to_string(inner) + ") runs in PID namespace " +
                    theirs.value()) == 0);
  }
  close(hold[1]);
  REQUIRE(waitpid(middle, nullptr, 0) == middle);
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
    // $CUDA_IPC_EXPORTER_BINARY: where a bundle of tests/gpu/bundle.sh put it on a GPU
    // machine (the build path compiled in does not exist there).
    const char* env = std::getenv("CUDA_IPC_EXPORTER_BINARY");
    std::string binary = env != nullptr && *env != '\0' ? env : CUDA_IPC_EXPORTER_BINARY;
    char* argv[] = {binary.data(), size.data(), nullptr};
    int rc = posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv, environ);
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

namespace {

// Records each release-word write into the event log's order, as (1000 + slot, stream), and
// the value written per slot.
class FakeWordWriter : public ReleaseWordWriter {
 public:
  FakeWordWriter(EventLog* log, std::uint32_t count, std::uint32_t base)
      : log_(log), count_(count), base_(base) {}
  std::uint32_t count() const override { return count_; }
  std::uint32_t base() const override { return base_; }
  Status Write(void* stream, std::uint32_t slot, std::uint32_t value) override {
    log_->records.emplace_back(1000 + static_cast<int>(slot), stream);
    values[slot] = value;
    return Status::Ok();
  }
  std::map<std::uint32_t, std::uint32_t> values;

 private:
  EventLog* log_;
  std::uint32_t count_;
  std::uint32_t base_;
};

}  // namespace

TEST_CASE("session events write each version's release word, after the copies and before the event") {
  EventLog log;
  auto writer = std::make_unique<FakeWordWriter>(&log, 64, 500);
  FakeWordWriter* words = writer.get();
  auto made =
      MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 2, nullptr,
                        std::move(writer));
  REQUIRE(made.ok());
  SessionEvents& events = *made.value();
  CHECK(events.writes_release_words());

  // The session's n-th version gets base + n, in the word of its daemon slot.
  auto v1 = events.Begin(7, 0);
  REQUIRE(v1.ok());
  CHECK(v1.value()->release_value() == std::optional<std::uint32_t>(501));
  RecordingLane a, b;
  REQUIRE(v1.value()->Signal({&a, &b}).ok());
  CHECK(a.after == std::vector<ckpt::CopyLane*>{&b});  // both lanes' copies come first
  // The word on lane a, then daemon event slot 0 on the same lane.
  CHECK(log.records == std::vector<std::pair<int, void*>>{{1000, &a}, {0, &a}});
  CHECK(words->values.at(0) == 501);

  auto v2 = events.Begin(8, 1);
  REQUIRE(v2.ok());
  CHECK(v2.value()->daemon_slot() == 1);
  CHECK(v2.value()->release_value() == std::optional<std::uint32_t>(502));
  REQUIRE(v2.value()->Signal({&a}).ok());
  CHECK(words->values.at(1) == 502);

  // A slot's word is written again only with a higher value: the slot is reused only once
  // its version is released (and superseded).
  v1.value()->Release();
  auto v3 = events.Begin(9, 0);
  REQUIRE(v3.ok());
  CHECK(v3.value()->daemon_slot() == 0);
  REQUIRE(v3.value()->Signal({&b}).ok());
  CHECK(words->values.at(0) == 503);
}

TEST_CASE("session events without usable release words signal with events only") {
  EventLog log;
  SECTION("no words") {
    auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 4);
    REQUIRE(made.ok());
    CHECK_FALSE(made.value()->writes_release_words());
    auto v = made.value()->Begin(1, 0);
    REQUIRE(v.ok());
    CHECK(v.value()->release_value() == std::nullopt);
  }
  SECTION("fewer words than daemon slots") {
    auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 4, nullptr,
                                  std::make_unique<FakeWordWriter>(&log, 3, 0));
    REQUIRE(made.ok());
    CHECK_FALSE(made.value()->writes_release_words());
    auto v = made.value()->Begin(1, 0);
    REQUIRE(v.ok());
    RecordingLane a;
    REQUIRE(v.value()->Signal({&a}).ok());
    CHECK(log.records == std::vector<std::pair<int, void*>>{{0, &a}});
  }
  SECTION("values wrap modulo 2^32 and skip 0, the words' initial value") {
    auto made = MakeSessionEvents(std::make_unique<FakeEventFactory>(&log), 0, TrainerHandles(2), 4, nullptr,
                                  std::make_unique<FakeWordWriter>(&log, 64, 0xfffffffeu));
    REQUIRE(made.ok());
    auto v1 = made.value()->Begin(1, 0);
    auto v2 = made.value()->Begin(2, 1);
    auto v3 = made.value()->Begin(3, 0);
    CHECK(v1.value()->release_value() == std::optional<std::uint32_t>(0xffffffffu));
    CHECK(v2.value()->release_value() == std::optional<std::uint32_t>(1));
    CHECK(v3.value()->release_value() == std::optional<std::uint32_t>(1));
  }
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
