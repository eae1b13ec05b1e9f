// Unit tests of the client's GPU path that need no device: the checks of a tensor's pointer
// attributes (cuda/cuda_pointer.h: classification, grouping by allocation, bounds,
// revalidation), the trainer event slot bookkeeping and the wait rules
// (client/cuda_tensors.h), and the real register_items path, which on a machine without a
// driver must fail with "no CUDA driver/device". Where a device exists, the real path is
// checked against real allocations instead (host, managed, pool and cudaMalloc memory).
#include <ckpt/client.h>
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "client/cuda_tensors.h"
#include "cuda/cuda_pointer.h"
#include "cuda/driver_api.h"
#include "cuda/pointer_query.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::cuda;

namespace {

constexpr std::uint64_t kBase = 0x7f0000000000ull;
constexpr std::uint64_t kMiB = 1ull << 20;

// What the driver reports for memory from cudaMalloc.
PointerAttributes DeviceAllocation(std::uint64_t base, std::uint64_t size, std::uint64_t buffer_id,
                                   int device = 0) {
  PointerAttributes a;
  a.memory_type = kMemoryTypeDevice;
  a.legacy_ipc_capable = true;
  a.device_ordinal = device;
  a.range_start = base;
  a.range_size = size;
  a.buffer_id = buffer_id;
  return a;
}

TensorPointer Tensor(std::string name, std::uint64_t address, std::uint64_t bytes, PointerAttributes a) {
  return TensorPointer{std::move(name), address, bytes, a};
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Runs `fn`, which must throw ckpt::Error with a message containing `text`; returns it.
template <typename Fn>
Error ExpectClientError(Fn&& fn, const std::string& text) {
  try {
    fn();
  } catch (const Error& e) {
    INFO("message: " << e.what());
    CHECK(Contains(e.what(), text));
    return e;
  }
  FAIL("expected a ckpt::Error containing '" << text << "'");
  return Error(0, "");
}

bool HaveDevice() { return Driver().ok(); }

}  // namespace

// ---- the driver queries behind the attributes ---------------------------------------------

namespace {

// A fake driver: one 2 MiB cudaMalloc block at kBlock, whose mappable range (what
// CU_POINTER_ATTRIBUTE_RANGE_START_ADDR/RANGE_SIZE report) is the whole block, while the
// allocation that contains an address (cuMemGetAddressRange) is a 256 KiB sub-allocation.
constexpr std::uint64_t kBlock = 0x7f1000000000ull;
constexpr std::uint64_t kSubAllocation = kBlock + 1 * kMiB;
constexpr std::uint64_t kSubBytes = 256 * 1024;
int range_calls = 0;

CUresult FakePointerGetAttributes(unsigned count, CUpointer_attribute* attributes, void** data,
                                  CUdeviceptr ptr) {
  const bool known = ptr >= kBlock && ptr < kBlock + 2 * kMiB;
  for (unsigned i = 0; i < count; ++i) {
    switch (attributes[i]) {
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned*>(data[i]) = known ? CU_MEMORYTYPE_DEVICE : 0;
        break;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *static_cast<unsigned char*>(data[i]) = 0;
        break;
      case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *static_cast<unsigned char*>(data[i]) = known ? 1 : 0;
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *static_cast<int*>(data[i]) = known ? 0 : -1;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *static_cast<CUdeviceptr*>(data[i]) = kBlock;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *static_cast<std::size_t*>(data[i]) = 2 * kMiB;
        break;
      case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *static_cast<unsigned long long*>(data[i]) = 77;
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

CUresult FakeMemGetAddressRange(CUdeviceptr* base, std::size_t* size, CUdeviceptr ptr) {
  ++range_calls;
  if (ptr >= kSubAllocation && ptr < kSubAllocation + kSubBytes) {
    *base = kSubAllocation;
    *size = kSubBytes;
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_NOT_FOUND;  // the rest of the block is not allocated
}

DriverApi FakeDriver() {
  DriverApi api;
  api.cuPointerGetAttributes = &FakePointerGetAttributes;
  api.cuMemGetAddressRange = &FakeMemGetAddressRange;
  return api;
}

}  // namespace

TEST_CASE("an allocation's base and size come from cuMemGetAddressRange, not the mappable range") {
  const DriverApi driver = FakeDriver();
  range_calls = 0;
  auto a = QueryPointerAttributes(driver, kSubAllocation + 4096);
  REQUIRE(a.ok());
  CHECK(a->memory_type == kMemoryTypeDevice);
  CHECK(a->legacy_ipc_capable);
  CHECK(a->buffer_id == 77);
  CHECK(a->range_start == kSubAllocation);
  CHECK(a->range_size == kSubBytes);
  CHECK(range_calls == 1);

  // The plan exports the sub-allocation's base, with offsets from it, and bounds checks
  // against its size, not the block's.
  auto plan = PlanAllocations({Tensor("w", kSubAllocation + 4096, 1024, a.value())});
  REQUIRE(plan.ok());
  CHECK(plan->allocations[0].base == kSubAllocation);
  CHECK(plan->allocations[0].size == kSubBytes);
  CHECK(plan->offset_of[0] == 4096);
  auto past = PlanAllocations({Tensor("big", kSubAllocation + 4096, kSubBytes, a.value())});
  REQUIRE_FALSE(past.ok());
  CHECK(Contains(past.status().message(), "run past the end of its allocation"));

  // An address of the block that no allocation holds (freed) reads as unknown memory.
  auto freed = QueryPointerAttributes(driver, kBlock + 16);
  REQUIRE(freed.ok());
  CHECK(freed->memory_type == kMemoryTypeUnknown);
  // Memory CUDA does not know needs no range query.
  range_calls = 0;
  auto host = QueryPointerAttributes(driver, 0x1000);
  REQUIRE(host.ok());
  CHECK(host->memory_type == kMemoryTypeUnknown);
  CHECK(range_calls == 0);
}

// ---- pointer classification -------------------------------------------------------------

TEST_CASE("a cudaMalloc pointer within its allocation is exportable") {
  auto a = DeviceAllocation(kBase, 4 * kMiB, 7);
  CHECK(CheckTensorPointer(Tensor("w", kBase, 4 * kMiB, a)).ok());          // the whole allocation
  CHECK(CheckTensorPointer(Tensor("w", kBase + kMiB, kMiB, a)).ok());       // a sub-allocation
  CHECK(CheckTensorPointer(Tensor("empty", kBase + 4 * kMiB, 0, a)).ok());  // zero bytes at the end
}

TEST_CASE("pointer classification: each refusal names the tensor and the way out") {
  auto a = DeviceAllocation(kBase, 4 * kMiB, 7);
  auto refused = [](const TensorPointer& t, const std::string& part) {
    Status s = CheckTensorPointer(t);
    INFO(s.message());
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(Contains(s.message(), "'" + t.name + "'"));
    CHECK(Contains(s.message(), part));
  };

  SECTION("a host pointer CUDA does not know") {
    refused(Tensor("host", 0x1000, 64, PointerAttributes{}), "not device memory");
  }
  SECTION("pinned or registered host memory") {
    PointerAttributes pinned = a;
    pinned.memory_type = kMemoryTypeHost;
    refused(Tensor("pinned", kBase, 64, pinned), "host memory");
  }
  SECTION("managed memory") {
    PointerAttributes managed = a;
    managed.managed = true;
    refused(Tensor("um", kBase, 64, managed), "allocate it with cudaMalloc");
  }
  SECTION("managed memory reported as unified") {
    PointerAttributes unified = a;
    unified.memory_type = 4;  // CU_MEMORYTYPE_UNIFIED
    refused(Tensor("u", kBase, 64, unified), "not device memory");
  }
  SECTION("a cuMem/VMM allocation (PyTorch expandable segments)") {
    PointerAttributes vmm = a;
    vmm.legacy_ipc_capable = false;
    refused(Tensor("seg", kBase, 64, vmm), "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False");
    refused(Tensor("seg", kBase, 64, vmm), "cuMem/VMM");
  }
  SECTION("tensor bytes run past the allocation's end") {
    refused(Tensor("big", kBase + kMiB, 3 * kMiB + 1, a), "past the end of its allocation");
    refused(Tensor("huge", kBase, ~0ull, a), "past the end");
  }
  SECTION("a pointer outside the reported range") {
    refused(Tensor("before", kBase - 8, 8, a), "past the end");
    refused(Tensor("after", kBase + 4 * kMiB + 1, 0, a), "past the end");
  }
  SECTION("no device ordinal") {
    PointerAttributes none = a;
    none.device_ordinal = -1;
    refused(Tensor("nodev", kBase, 64, none), "no device");
  }
}

// ---- grouping by allocation -------------------------------------------------------------

TEST_CASE("tensors are grouped by allocation with offsets from its base") {
  auto a = DeviceAllocation(kBase, 8 * kMiB, 11);
  auto b = DeviceAllocation(kBase + 64 * kMiB, 2 * kMiB, 12);
  std::vector<TensorPointer> tensors = {
      Tensor("w0", kBase, kMiB, a),
      Tensor("w1", kBase + 64 * kMiB + 512, 1024, b),
      Tensor("w2", kBase + 3 * kMiB, 5 * kMiB, a),
  };
  auto plan = PlanAllocations(tensors);
  REQUIRE(plan.ok());
  CHECK(plan->device == 0);
  REQUIRE(plan->allocations.size() == 2);
  CHECK(plan->allocations[0].base == kBase);
  CHECK(plan->allocations[0].size == 8 * kMiB);
  CHECK(plan->allocations[0].buffer_id == 11);
  CHECK(plan->allocations[0].first_tensor == "w0");
  CHECK(plan->allocations[0].tensor_count == 2);
  CHECK(plan->allocations[1].first_tensor == "w1");
  CHECK(plan->allocations[1].tensor_count == 1);
  CHECK(plan->allocation_of == std::vector<std::size_t>{0, 1, 0});
  CHECK(plan->offset_of == std::vector<std::uint64_t>{0, 512, 3 * kMiB});
}

TEST_CASE("grouping refuses tensors on two devices and one bad tensor among many") {
  SECTION("two devices") {
    std::vector<TensorPointer> tensors = {
        Tensor("a", kBase, 64, DeviceAllocation(kBase, kMiB, 1, 0)),
        Tensor("b", kBase + 16 * kMiB, 64, DeviceAllocation(kBase + 16 * kMiB, kMiB, 2, 1)),
    };
    auto plan = PlanAllocations(tensors);
    REQUIRE_FALSE(plan.ok());
    INFO(plan.status().message());
    CHECK(Contains(plan.status().message(), "'a' (device 0)"));
    CHECK(Contains(plan.status().message(), "'b' (device 1)"));
    CHECK(Contains(plan.status().message(), "one device"));
  }
  SECTION("the second tensor runs past its allocation") {
    auto a = DeviceAllocation(kBase, kMiB, 1);
    auto plan = PlanAllocations({Tensor("ok", kBase, 64, a), Tensor("long", kBase + 64, kMiB, a)});
    REQUIRE_FALSE(plan.ok());
    CHECK(Contains(plan.status().message(), "'long'"));
  }
  SECTION("one base reported as two allocations") {
    auto plan = PlanAllocations({Tensor("x", kBase, 64, DeviceAllocation(kBase, kMiB, 1)),
                                 Tensor("y", kBase + 64, 64, DeviceAllocation(kBase, kMiB, 2))});
    REQUIRE_FALSE(plan.ok());
    CHECK(Contains(plan.status().message(), "'x' and 'y'"));
  }
}

// ---- revalidation -----------------------------------------------------------------------

TEST_CASE("revalidation: same start and size and buffer id and device or a clear error") {
  auto registered = Allocation{kBase, 8 * kMiB, 11, "w0", 3};
  CHECK(CheckAllocationUnchanged(registered, 0, DeviceAllocation(kBase, 8 * kMiB, 11)).ok());

  auto moved = [&](const PointerAttributes& now) {
    Status s = CheckAllocationUnchanged(registered, 0, now);
    INFO(s.message());
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(s.message(), "tensor 'w0' moved or was freed since registration: register again"));
    CHECK(Contains(s.message(), "2 other tensors"));
    return s.message();
  };
  CHECK(Contains(moved(PointerAttributes{}), "no allocation is there"));          // freed
  CHECK(Contains(moved(DeviceAllocation(kBase, 8 * kMiB, 12)), "buffer id 12"));  // freed, reallocated there
  CHECK(Contains(moved(DeviceAllocation(kBase, 4 * kMiB, 11)), "another allocation"));  // other size
  CHECK(Contains(moved(DeviceAllocation(kBase - kMiB, 16 * kMiB, 11)), "another allocation"));
  moved(DeviceAllocation(kBase, 8 * kMiB, 11, 1));  // another device
}

// ---- trainer event slots ----------------------------------------------------------------

TEST_CASE("trainer slots go round-robin and are reused only after a Wait on their version") {
  TrainerSlotBook book(4);
  CHECK(book.size() == 4);
  for (std::uint64_t v = 1; v <= 4; ++v) {
    CHECK(book.next_slot() == (v - 1) % 4);
    CHECK_FALSE(book.MustWaitFor().has_value());
    CHECK(book.Take(v) == (v - 1) % 4);
  }
  // Slot 0 holds version 1, on which no Wait returned yet.
  CHECK(book.next_slot() == 0);
  REQUIRE(book.MustWaitFor() == std::optional<std::uint64_t>(1));
  book.Release(3);  // another slot: slot 0 stays held
  CHECK(book.MustWaitFor() == std::optional<std::uint64_t>(1));
  CHECK_FALSE(book.holder(2).has_value());
  book.Release(1);
  CHECK_FALSE(book.MustWaitFor().has_value());
  CHECK(book.Take(5) == 0);
  CHECK(book.next_slot() == 1);
  CHECK(book.MustWaitFor() == std::optional<std::uint64_t>(2));
  book.Release(99);  // unknown versions change nothing
  CHECK(book.holder(1) == std::optional<std::uint64_t>(2));
}

TEST_CASE(
    "slot waits: none for a trainer that waits on every version and one per snapshot after lap one "
    "otherwise") {
  SECTION("waits on every version") {
    TrainerSlotBook book;
    CHECK(book.size() == kTrainerEventSlots);
    for (std::uint64_t v = 1; v <= 500; ++v) {
      REQUIRE_FALSE(book.MustWaitFor().has_value());
      book.Take(v);
      book.Release(v);  // wait_snapshot_on_stream(v) returned
    }
  }
  SECTION("never waits") {
    TrainerSlotBook book;
    for (std::uint64_t v = 1; v <= kTrainerEventSlots; ++v) {
      REQUIRE_FALSE(book.MustWaitFor().has_value());
      book.Take(v);
    }
    // The 65th snapshot must first wait for version 1, the 66th for version 2.
    REQUIRE(book.MustWaitFor() == std::optional<std::uint64_t>(1));
    book.Release(1);
    book.Take(kTrainerEventSlots + 1);
    CHECK(book.MustWaitFor() == std::optional<std::uint64_t>(2));
  }
  SECTION("a version snapshotted twice (a refused retry) holds two slots, freed by one Wait") {
    TrainerSlotBook book(3);
    book.Take(7);
    book.Take(7);
    book.Take(8);
    CHECK(book.MustWaitFor() == std::optional<std::uint64_t>(7));
    book.Release(7);
    CHECK_FALSE(book.holder(0).has_value());
    CHECK_FALSE(book.holder(1).has_value());
    CHECK(book.holder(2) == std::optional<std::uint64_t>(8));
  }
}

TEST_CASE("which Wait returns free a slot") {
  CHECK(WaitReleasesSlot(grpc::StatusCode::OK));
  CHECK(WaitReleasesSlot(grpc::StatusCode::NOT_FOUND));           // unknown or forgotten version
  CHECK(WaitReleasesSlot(grpc::StatusCode::UNKNOWN));             // the version failed (I/O)
  CHECK(WaitReleasesSlot(grpc::StatusCode::RESOURCE_EXHAUSTED));  // the version failed (no space)
  CHECK(WaitReleasesSlot(grpc::StatusCode::FAILED_PRECONDITION));
  CHECK_FALSE(WaitReleasesSlot(grpc::StatusCode::DEADLINE_EXCEEDED));  // a timeout tells nothing
  CHECK_FALSE(WaitReleasesSlot(grpc::StatusCode::UNAVAILABLE));
  CHECK_FALSE(WaitReleasesSlot(grpc::StatusCode::CANCELLED));
}

TEST_CASE("stream-ordered waits only for GPU registrations and the last snapshot or newer") {
  CHECK(UseStreamOrderedWait(true, 10, 10));
  CHECK(UseStreamOrderedWait(true, 10, 11));
  CHECK_FALSE(UseStreamOrderedWait(true, 10, 9));    // older: its events may be reused
  CHECK_FALSE(UseStreamOrderedWait(false, 10, 10));  // host-only registration
  CHECK(UseStreamOrderedWait(true, 0, 1));
}

// ---- the real client path ---------------------------------------------------------------

TEST_CASE("register_items with a GPU tensor fails with no driver/device or with the pointer's own error") {
  // No daemon is needed: GPU tensors are checked before any call.
  Client client = Client::connect("/nonexistent-ckptd-dir/ckptd.sock");
  int host_value = 0;
  TensorItem item{"w", DType::kF32, {1}, nullptr, 0, &host_value};
  if (!HaveDevice()) {
    Error e = ExpectClientError([&] { client.register_items("job", 0, 1, {item}); }, "no CUDA driver/device");
    CHECK(Contains(e.what(), "GPU tensor 'w'"));
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  } else {
    Error e = ExpectClientError([&] { client.register_items("job", 0, 1, {item}); }, "not device memory");
    CHECK(e.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  }
}

TEST_CASE("register_items refuses an item with both a region and a cuda_ptr") {
  Client client = Client::connect("/nonexistent-ckptd-dir/ckptd.sock");
  auto region = SharedRegion::create(4096);
  int x = 0;
  TensorItem item{"both", DType::kU8, {16}, region, 0, &x};
  Error e =
      ExpectClientError([&] { client.register_items("job", 0, 1, {item}); }, "both a region and a cuda_ptr");
  CHECK(e.code() == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
}

TEST_CASE(
    "a refused GPU registration leaves the host registration in place and host-only stream waits wait on the "
    "host") {
  test::TempDir dir("cuda-client");
  test::DaemonOptions options;
  options.root = dir.path() + "/root";
  options.socket = dir.path() + "/sock/ckptd.sock";
  test::DaemonProcess daemon(options);
  test::TrainerState state(2, 64 * 1024, 5);
  Client client = Client::connect(daemon.socket());
  client.register_items("gpujob", 0, 1, state.Items());

  state.Fill(1);
  client.snapshot(1, {}, nullptr);
  // A host-only registration: the stream-ordered form is wait_snapshot (the null stream is
  // never touched).
  client.wait_snapshot_on_stream(1, nullptr);
  CHECK(state.FirstMismatch(1) == -1);

  // Adding a GPU tensor that cannot be registered here is refused before anything changes.
  std::vector<TensorItem> items = state.Items();
  int host_value = 0;
  items.push_back(TensorItem{"gpu", DType::kF32, {1}, nullptr, 0, &host_value});
  ExpectClientError([&] { client.register_items("gpujob", 0, 1, items); },
                    HaveDevice() ? "not device memory" : "no CUDA driver/device");

  state.Fill(2);
  client.snapshot(2);
  client.wait_snapshot_on_stream(2, nullptr);
  client.wait_durable(2);
  auto status = client.status();
  CHECK(Contains(status.json, "\"gpujob\""));
}

// ---- with a device ----------------------------------------------------------------------

TEST_CASE("with a device: real allocations are classified as the fakes are") {
  if (!HaveDevice()) {
    SUCCEED("no CUDA device here");
    return;
  }
  Client client = Client::connect("/nonexistent-ckptd-dir/ckptd.sock");
  auto item = [](const char* name, const void* ptr, std::int64_t n) {
    return TensorItem{name, DType::kU8, {n}, nullptr, 0, ptr};
  };

  SECTION("cudaMalloc memory passes the checks and fails only at the missing daemon") {
    void* d = nullptr;
    REQUIRE(cudaMalloc(&d, kMiB) == cudaSuccess);
    auto* p = static_cast<char*>(d);
    // Resolve, export and event creation all succeed; the call then fails to reach ckptd.
    ExpectClientError(
        [&] {
          client.register_items("job", 0, 1, {item("a", p, 4096), item("b", p + 4096, 4096)});
        },
        "is ckptd running?");
    ExpectClientError([&] { client.register_items("job", 0, 1, {item("long", p + 4096, kMiB)}); },
                      "past the end of its allocation");
    cudaFree(d);
  }
  SECTION("pinned host memory") {
    void* h = nullptr;
    REQUIRE(cudaMallocHost(&h, 4096) == cudaSuccess);
    ExpectClientError([&] { client.register_items("job", 0, 1, {item("pinned", h, 4096)}); }, "host memory");
    cudaFreeHost(h);
  }
  SECTION("managed memory") {
    void* m = nullptr;
    REQUIRE(cudaMallocManaged(&m, 4096) == cudaSuccess);
    ExpectClientError([&] { client.register_items("job", 0, 1, {item("um", m, 4096)}); },
                      "allocate it with cudaMalloc");
    cudaFree(m);
  }
  SECTION("stream-ordered pool memory is not legacy-IPC capable") {
    void* a = nullptr;
    REQUIRE(cudaMallocAsync(&a, kMiB, nullptr) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
    ExpectClientError([&] { client.register_items("job", 0, 1, {item("pool", a, 4096)}); },
                      "expandable_segments:False");
    cudaFreeAsync(a, nullptr);
    cudaStreamSynchronize(nullptr);
  }
}
