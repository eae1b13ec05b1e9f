// When a real ckptd lets go of a trainer's GPU memory, seen without a GPU: the daemon runs
// with CKPTD_TEST_DEVICE (cuda/test_device_backend.h), whose "allocations" are POSIX
// shared-memory objects of this test and whose every open and close of one is logged. The
// IPC handle cache and the releaser thread are the production ones.
//
// Checked: a captured version holds no mapping; Unregister and a re-registration close the
// allocations the session no longer names before they reply; a close that never returns
// holds up neither the replies (beyond their bound), nor other trainers, nor SIGTERM; a
// sticky CUDA error makes the daemon exit with status 70.
#include <cstdlib>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "shm/descriptor_table.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

constexpr std::size_t kAllocBytes = 1 << 20;

// A trainer's "GPU allocation": a shared-memory object whose name is the IPC handle.
class FakeAllocation {
 public:
  explicit FakeAllocation(const std::string& tag) {
    static int serial = 0;
    name_ = "/ckpt-fakegpu-" + std::to_string(::getpid()) + "-" + tag + "-" + std::to_string(serial++);
    int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, kAllocBytes) == 0);
    std::string bytes(kAllocBytes, static_cast<char>(tag[0]));
    REQUIRE(::pwrite(fd, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  }
  ~FakeAllocation() { ::shm_unlink(name_.c_str()); }
  const std::string& name() const { return name_; }
  // "cuda:<uuid>:<handle>": the handle's bytes are the object's name, NUL padded.
  std::string region() const {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string handle(64, '\0');
    std::memcpy(handle.data(), name_.data(), name_.size());
    std::string hex;
    for (unsigned char c : handle) {
      hex.push_back(kDigits[c >> 4]);
      hex.push_back(kDigits[c & 0xf]);
    }
    return "cuda:" + std::string(32, 'a') + ":" + hex;
  }

 private:
  std::string name_;
};

// How often the log says `what` (open, closing, close) of `alloc`.
int Count(const std::string& log, const std::string& what, const FakeAllocation& alloc) {
  std::ifstream in(log);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += line == what + " " + alloc.name();
  return n;
}

struct Fixture {
  explicit Fixture(std::string extra = "") {
    ::setenv("CKPTD_TEST_DEVICE", ("log=" + log + extra).c_str(), 1);
    daemon = std::make_unique<DaemonProcess>(Options());
    ::unsetenv("CKPTD_TEST_DEVICE");
    stub = daemon->Stub();
  }

  DaemonOptions Options() const {
    DaemonOptions o;
    o.root = dir.path() + "/root";
    o.socket = dir.path() + "/sock/ckptd.sock";
    // ckptd-test-device: ckptd with the fake device; $CKPTD_TEST_DEVICE_BINARY where a GPU
    // bundle (tests/gpu/bundle.sh) put it.
    const char* bundled = std::getenv("CKPTD_TEST_DEVICE_BINARY");
    o.binary = bundled != nullptr && *bundled != '\0' ? bundled : CKPTD_TEST_DEVICE_BINARY;
    return o;
  }

  // Writes `allocs` into `table` as one 4 KiB tensor each, at offset 4096.
  static void Fill(DescriptorTable& table, const std::vector<const FakeAllocation*>& allocs) {
    std::vector<TableItem> rows;
    for (std::size_t i = 0; i < allocs.size(); ++i) {
      TableItem row;
      row.name = "t" + std::to_string(i);
      row.shape = {4096};
      row.region = allocs[i]->region();
      row.offset = 4096;
      row.length = 4096;
      rows.push_back(row);
    }
    REQUIRE(table.Write(rows).ok());
  }

  v1::RegisterReply Register(const std::string& job, const DescriptorTable& table,
                             const std::string& session = "") {
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_job(job);
    req.set_rank(0);
    req.set_world_size(1);
    req.set_descriptor_table(table.name());
    req.set_session(session);
    req.mutable_cuda()->set_device_uuid(std::string(32, 'a'));
    for (int i = 0; i < 64; ++i) req.mutable_cuda()->add_trainer_events(std::string(64, 't'));
    v1::RegisterReply rep;
    grpc::Status s = stub->Register(&ctx, req, &rep);
    INFO(s.error_message());
    REQUIRE(s.ok());
    return rep;
  }

  grpc::Status Snapshot(const std::string& session, std::uint64_t version, const DescriptorTable& table) {
    grpc::ClientContext ctx;
    v1::SnapshotRequest req;
    req.set_session(session);
    req.set_version(version);
    req.set_table_generation(table.generation());
    req.set_trainer_event_slot(0);
    v1::SnapshotReply rep;
    return stub->Snapshot(&ctx, req, &rep);
  }

  void WaitDurable(const std::string& session, std::uint64_t version) {
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    req.set_session(session);
    req.set_version(version);
    req.set_level(v1::LEVEL_PERSISTED);
    req.set_timeout_ms(60000);
    v1::WaitReply rep;
    grpc::Status s = stub->Wait(&ctx, req, &rep);
    INFO(s.error_message());
    REQUIRE(s.ok());
  }

  grpc::Status Unregister(const std::string& session) {
    grpc::ClientContext ctx;
    v1::UnregisterRequest req;
    req.set_session(session);
    v1::UnregisterReply rep;
    return stub->Unregister(&ctx, req, &rep);
  }

  TempDir dir{"devrel"};
  const std::string log = dir.path() + "/device.log";
  std::unique_ptr<DaemonProcess> daemon;
  std::unique_ptr<v1::Checkpoint::Stub> stub;
};

}  // namespace

TEST_CASE(
    "a captured version keeps no trainer allocation mapped, and unregister closes them before it replies") {
  Fixture f;
  FakeAllocation a("a"), b("b");
  auto table = DescriptorTable::Create("", 16);
  REQUIRE(table.ok());
  Fixture::Fill(table.value(), {&a, &b});
  auto rep = f.Register("job", table.value());
  CHECK(Count(f.log, "open", a) == 1);
  CHECK(Count(f.log, "open", b) == 1);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    REQUIRE(f.Snapshot(rep.session(), v, table.value()).ok());
    f.WaitDurable(rep.session(), v);
  }
  CHECK(Count(f.log, "open", a) == 1);  // one mapping per allocation, however many versions
  CHECK(Count(f.log, "close", a) == 0);
  REQUIRE(f.Unregister(rep.session()).ok());
  // Read at once: the closes are done before the reply, and no recent shard holds one.
  CHECK(Count(f.log, "close", a) == 1);
  CHECK(Count(f.log, "close", b) == 1);
  // The versions are intact (their bytes were copied before the mappings went).
  auto status = f.daemon->Status();
  CHECK(status.clients_size() == 0);
}

TEST_CASE("a re-registration closes the allocations its new table no longer names before it replies") {
  Fixture f;
  FakeAllocation a("a"), b("b"), c("c");
  auto table = DescriptorTable::Create("", 16);
  REQUIRE(table.ok());
  Fixture::Fill(table.value(), {&a, &b});
  auto rep = f.Register("job", table.value());
  REQUIRE(f.Snapshot(rep.session(), 1, table.value()).ok());
  f.WaitDurable(rep.session(), 1);

  // The trainer reallocated b as c (PyTorch frees b once the daemon's reply came).
  Fixture::Fill(table.value(), {&a, &c});
  auto again = f.Register("job", table.value(), rep.session());
  CHECK(again.session() == rep.session());
  CHECK(Count(f.log, "close", b) == 1);
  CHECK(Count(f.log, "open", c) == 1);
  CHECK(Count(f.log, "open", a) == 1);  // still named: kept, not reopened
  CHECK(Count(f.log, "close", a) == 0);

  REQUIRE(f.Snapshot(rep.session(), 2, table.value()).ok());
  f.WaitDurable(rep.session(), 2);
  REQUIRE(f.Unregister(rep.session()).ok());
  CHECK(Count(f.log, "close", a) == 1);
  CHECK(Count(f.log, "close", c) == 1);
  CHECK(Count(f.log, "close", b) == 1);
}

TEST_CASE("a close that never returns holds up no other trainer and no SIGTERM") {
  TempDir block_dir{"block"};
  const std::string block = block_dir.path() + "/block";
  { std::ofstream(block) << "held"; }
  Fixture f(",block_close=" + block);
  FakeAllocation a("a"), b("b");
  auto table = DescriptorTable::Create("", 16);
  REQUIRE(table.ok());
  Fixture::Fill(table.value(), {&a});
  auto rep = f.Register("job", table.value());
  REQUIRE(f.Snapshot(rep.session(), 1, table.value()).ok());
  f.WaitDurable(rep.session(), 1);

  // Unregister replies once its bound (SessionTable::kReleaseWait, 2 s) has passed.
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(f.Unregister(rep.session()).ok());
  const double unregister_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(unregister_s < 4.0);
  CHECK(Count(f.log, "closing", a) == 1);  // on the releaser thread, stuck
  CHECK(Count(f.log, "close", a) == 0);

  // Another trainer registers and checkpoints meanwhile.
  auto other_table = DescriptorTable::Create("", 16);
  REQUIRE(other_table.ok());
  Fixture::Fill(other_table.value(), {&b});
  auto other = f.Register("job2", other_table.value());
  REQUIRE(f.Snapshot(other.session(), 1, other_table.value()).ok());
  f.WaitDurable(other.session(), 1);
  CHECK(f.daemon->Status().clients_size() == 1);

  // SIGTERM ends the daemon although the close still does not return.
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(f.daemon->Stop() == 0);
  const double stop_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  CHECK(stop_s < 10.0);
  CHECK(Count(f.log, "close", a) == 0);
  INFO("unregister took " << unregister_s << " s, SIGTERM " << stop_s << " s");
}

TEST_CASE("a sticky CUDA error makes the daemon exit non-zero for a restart") {
  Fixture f(",sticky_copy=1");
  FakeAllocation a("a");
  auto table = DescriptorTable::Create("", 16);
  REQUIRE(table.ok());
  Fixture::Fill(table.value(), {&a});
  auto rep = f.Register("job", table.value());
  REQUIRE(f.Snapshot(rep.session(), 1, table.value()).ok());
  const int code = f.daemon->WaitExit(std::chrono::seconds(30));
  CHECK(code == 70);
  const std::string log = f.daemon->Log();
  INFO(log);
  CHECK(log.find("CUDA context of ckptd is unusable") != std::string::npos);
  CHECK(log.find("cudaErrorIllegalAddress") != std::string::npos);
}
