// The GPU side of a client across a daemon restart, without a GPU: a fake CudaTensors
// (through libckpt's test seam, client/cuda_tensors.h) stands for the trainer's CUDA
// tensors and event rings, and a fake ckpt.v1 service on a Unix socket stands for the
// daemon, so the test sees every request. A real ckptd cannot take part: it would import
// the handles through a CUDA driver this machine may not have. Checked: the restarted
// daemon gets the same device, table and trainer event handles (nothing resolved or
// exported again), the client opens the new daemon's events, the trainer's event slots
// start over, and a lost version is answered on the host, never by a stream wait on an
// event of the dead daemon.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client/cuda_tensors.h"
#include "client/release_words.h"
#include "common/pid_namespace.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

constexpr std::uint32_t kSlots = 64;

// What the fake CUDA side was asked to do.
struct CudaLog {
  std::mutex mu;
  int resolved = 0;
  int prepared = 0;
  std::vector<std::vector<std::string>> opened;  // daemon event handles, per OpenDaemonEvents
  std::vector<std::uint32_t> recorded;           // trainer slots recorded, in order
  std::vector<std::uint32_t> waited;             // daemon slots a stream waited on
  int mapped = 0;                                // MapReleaseWords calls
  // Stream waits on release words: the word (in the client's page) and the value awaited.
  std::vector<std::pair<const std::atomic<std::uint32_t>*, std::uint32_t>> word_waits;
};

class FakeCuda : public CudaTensors {
 public:
  FakeCuda(std::shared_ptr<CudaLog> log, std::size_t tensors) : log_(std::move(log)) {
    for (std::size_t i = 0; i < tensors; ++i) {
      rows_.push_back(CudaTableRow{
          "cuda:" + std::string(32, 'a') + ":" + std::string(127, 'b') + std::to_string(i), 0, 1});
    }
    for (std::uint32_t i = 0; i < kSlots; ++i)
      trainer_events_.push_back("trainer-event-" + std::to_string(i));
  }
  const std::vector<CudaTableRow>& rows() const override { return rows_; }
  const std::string& device_uuid() const override { return uuid_; }
  Result<bool> PrepareEvents(const CudaTensors* previous) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    ++log_->prepared;
    return previous != nullptr;
  }
  std::vector<std::string> trainer_event_handles() const override { return trainer_events_; }
  Status OpenDaemonEvents(const std::vector<std::string>& handles) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->opened.push_back(handles);
    return Status::Ok();
  }
  Status Revalidate() const override { return Status::Ok(); }
  Status RecordTrainerEvent(std::uint32_t slot, void*) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->recorded.push_back(slot);
    return Status::Ok();
  }
  Status WaitDaemonEvent(std::uint32_t slot, void*) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->waited.push_back(slot);
    return Status::Ok();
  }
  Status SynchronizeDevice() const override { return Status::Ok(); }
  Result<std::shared_ptr<const void>> MapReleaseWords(void*, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    ++log_->mapped;
    if (bytes != kReleaseWordsBytes) return InvalidArgument("not a page of words");
    return std::shared_ptr<const void>(std::make_shared<int>(0));
  }
  Result<bool> WaitReleaseWord(const void* word, std::uint32_t value, void*) override {
    std::lock_guard<std::mutex> lock(log_->mu);
    log_->word_waits.emplace_back(static_cast<const std::atomic<std::uint32_t>*>(word), value);
    return true;
  }

 private:
  std::shared_ptr<CudaLog> log_;
  std::vector<CudaTableRow> rows_;
  std::string uuid_ = std::string(32, 'a');
  std::vector<std::string> trainer_events_;
};

// A daemon that answers just enough of ckpt.v1 and records what it was sent.
class FakeDaemon final : public v1::Checkpoint::Service {
 public:
  FakeDaemon(std::string socket, std::string instance) : instance_(std::move(instance)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_);
  }
  ~FakeDaemon() override { Crash(); }
  // Stops serving at once, as a daemon killed with SIGKILL does.
  void Crash() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
  }

  std::vector<std::string> DaemonEvents() const {
    std::vector<std::string> out;
    for (std::uint32_t i = 0; i < kSlots; ++i)
      out.push_back(instance_ + "-daemon-event-" + std::to_string(i));
    return out;
  }

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                        v1::RegisterReply* rep) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!req->session().empty() && sessions_.count(req->session()) == 0)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown session");
    registers.push_back(*req);
    const std::string id = req->session().empty() ? instance_ + "-session" : req->session();
    sessions_.insert(id);
    rep->set_session(id);
    rep->set_item_count(1);
    rep->set_daemon_instance(instance_);
    // As ckptd does when it can write the trainer's release words.
    if (words_pid > 0 && !req->cuda().release_words().empty()) {
      rep->set_release_words(true);
      rep->set_daemon_pid(words_pid);
      rep->set_daemon_pid_namespace(words_namespace);
      release_base_ = req->cuda().release_base();
    }
    for (const auto& h : DaemonEvents()) rep->add_daemon_events(h);
    return grpc::Status::OK;
  }
  grpc::Status Snapshot(grpc::ServerContext*, const v1::SnapshotRequest* req, v1::SnapshotReply*) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.count(req->session()) == 0)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown session");
    snapshots[req->version()] = req->trainer_event_slot();
    release_values_[req->version()] = release_base_ + static_cast<std::uint32_t>(snapshots.size());
    return grpc::Status::OK;
  }
  grpc::Status Wait(grpc::ServerContext*, const v1::WaitRequest* req, v1::WaitReply* rep) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.count(req->session()) == 0)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown session");
    if (snapshots.count(req->version()) == 0)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "version not snapshotted by this session");
    if (req->stream_ordered()) {
      rep->set_has_daemon_event(true);
      rep->set_daemon_event_slot(static_cast<std::uint32_t>(req->version() % kSlots));
      if (words_pid > 0) rep->set_release_value(release_values_.at(req->version()));
      return grpc::Status::OK;
    }
    rep->set_reached(req->level());
    return grpc::Status::OK;
  }
  grpc::Status List(grpc::ServerContext*, const v1::ListRequest*, v1::ListReply*) override {
    return grpc::Status::OK;  // nothing on storage
  }
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusReply* rep) override {
    rep->set_daemon_instance(instance_);
    return grpc::Status::OK;
  }
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterReply*) override {
    return grpc::Status::OK;
  }

  std::vector<v1::RegisterRequest> registers;
  std::map<std::uint64_t, std::uint32_t> snapshots;  // version -> trainer event slot
  // Set before the registration: the daemon "writes" the release words, and this is the
  // process (a real ckptd) the client is told to watch.
  pid_t words_pid = 0;
  std::string words_namespace = PidNamespaceOf(0).value();

 private:
  std::uint32_t release_base_ = 0;
  std::map<std::uint64_t, std::uint32_t> release_values_;
  std::mutex mu_;
  std::set<std::string> sessions_;
  const std::string instance_;
  std::unique_ptr<grpc::Server> server_;
};

// A real ckptd on a socket of its own, standing for the fake daemon's process.
DaemonOptions ProcessOptions(const TempDir& dir, const std::string& name) {
  DaemonOptions o;
  o.root = dir.path() + "/root-" + name;
  o.socket = dir.path() + "/" + name + ".sock";
  return o;
}

// Installs the fake CUDA side for one test.
struct FakeCudaSeam {
  std::shared_ptr<CudaLog> log = std::make_shared<CudaLog>();
  FakeCudaSeam() {
    SetCudaTensorsResolverForTesting([log = log](const std::vector<CudaTensorSpec>& specs) {
      {
        std::lock_guard<std::mutex> lock(log->mu);
        ++log->resolved;
      }
      return Result<std::shared_ptr<CudaTensors>>(std::make_shared<FakeCuda>(log, specs.size()));
    });
  }
  ~FakeCudaSeam() { SetCudaTensorsResolverForTesting(nullptr); }
};

}  // namespace

TEST_CASE("a GPU registration is made again with the same handles after a daemon restart", "[restart][gpu]") {
  TempDir dir("gpu-restart");
  const std::string socket = dir.path() + "/ckptd.sock";
  FakeCudaSeam seam;
  auto a = std::make_unique<FakeDaemon>(socket, "instance-a");
  ClientOptions options;
  options.reconnect_budget = std::chrono::seconds(20);
  Client client = Client::connect(socket, options);
  static float device_memory[256];  // stands for the tensor's device address
  client.register_items("gpu", 0, 1, {{"w", DType::kF32, {256}, nullptr, 0, device_memory}});
  REQUIRE(a->registers.size() == 1);
  const v1::RegisterRequest first = a->registers[0];
  CHECK(first.cuda().device_uuid() == std::string(32, 'a'));
  CHECK(first.cuda().trainer_events_size() == static_cast<int>(kSlots));
  REQUIRE(seam.log->opened.size() == 1);
  CHECK(seam.log->opened[0] == a->DaemonEvents());

  void* stream = reinterpret_cast<void*>(0x5);
  client.snapshot(1, {}, stream);
  client.wait_snapshot_on_stream(1, stream);  // the stream waits on A's event for version 1
  client.snapshot(2, {}, stream);
  CHECK(seam.log->recorded == std::vector<std::uint32_t>{0, 1});
  CHECK(seam.log->waited == std::vector<std::uint32_t>{1});

  a->Crash();
  auto b = std::make_unique<FakeDaemon>(socket, "instance-b");
  // Version 2 was in flight on A: lost. The answer comes from the host: no stream waits on
  // an event of the dead daemon, nor of the new one (which never saw version 2).
  CHECK_THROWS_WITH(client.wait_snapshot_on_stream(2, stream),
                    Catch::Contains("daemon restarted; version 2 was not captured"));
  CHECK(seam.log->waited == std::vector<std::uint32_t>{1});
  // B got the same registration: a new session, the same job, table, device and trainer
  // events (the trainer's event ring is not made again, the tensors not resolved again),
  // and the client opened B's events.
  REQUIRE(b->registers.size() == 1);
  const v1::RegisterRequest again = b->registers[0];
  CHECK(again.session().empty());
  CHECK(again.job() == "gpu");
  CHECK(again.rank() == 0);
  CHECK(again.world_size() == 1);
  CHECK(again.descriptor_table() == first.descriptor_table());
  CHECK(again.cuda().device_uuid() == first.cuda().device_uuid());
  CHECK(std::equal(again.cuda().trainer_events().begin(), again.cuda().trainer_events().end(),
                   first.cuda().trainer_events().begin(), first.cuda().trainer_events().end()));
  // The same release words, with a base above every value A may have been told to write.
  CHECK(again.cuda().release_words() == first.cuda().release_words());
  CHECK(again.cuda().release_base() == 2);
  CHECK(seam.log->resolved == 1);
  CHECK(seam.log->prepared == 1);
  REQUIRE(seam.log->opened.size() == 2);
  CHECK(seam.log->opened[1] == b->DaemonEvents());

  // B waits on none of the events recorded for A: the trainer's slots start over.
  client.snapshot(3, {}, stream);
  CHECK(seam.log->recorded.back() == 0);
  CHECK(b->snapshots.at(3) == 0);
  client.wait_snapshot_on_stream(3, stream);
  CHECK(seam.log->waited == std::vector<std::uint32_t>{1, 3});
  client.unregister();
}

TEST_CASE("a stream waiting on a daemon that dies is released by the client, and the version reported lost",
          "[restart][gpu]") {
  TempDir dir("gpu-release");
  const std::string socket = dir.path() + "/ckptd.sock";
  FakeCudaSeam seam;
  // The daemons' processes: real ckptd processes (on sockets of their own), which the
  // client is told to watch, as a ckptd reports its own pid.
  auto process_a = std::make_unique<DaemonProcess>(ProcessOptions(dir, "a"));
  auto a = std::make_unique<FakeDaemon>(socket, "instance-a");
  a->words_pid = process_a->pid();
  ClientOptions options;
  options.reconnect_budget = std::chrono::seconds(20);
  Client client = Client::connect(socket, options);
  static float device_memory[256];
  client.register_items("gpu", 0, 1, {{"w", DType::kF32, {256}, nullptr, 0, device_memory}});
  REQUIRE(a->registers.size() == 1);
  CHECK(a->registers[0].cuda().release_words().rfind("/ckpt-release-", 0) == 0);
  CHECK(a->registers[0].cuda().release_base() == 0);
  CHECK(seam.log->mapped == 1);
  CHECK(client.stream_wait() == "release words");

  void* stream = reinterpret_cast<void*>(0x5);
  client.snapshot(1, {}, stream);
  client.wait_snapshot_on_stream(1, stream);
  REQUIRE(seam.log->word_waits.size() == 1);
  const std::atomic<std::uint32_t>* word = seam.log->word_waits[0].first;
  const std::uint32_t value = seam.log->word_waits[0].second;
  CHECK(value == 1);
  CHECK(seam.log->waited.empty());  // no wait on the daemon's event
  // The daemon never wrote the word (its copies did not run): the stream would wait.
  CHECK(static_cast<std::int32_t>(word->load() - value) < 0);

  // The daemon's process dies: the client writes the word itself, and the stream goes on.
  process_a->Kill9();
  REQUIRE(Eventually([&] { return static_cast<std::int32_t>(word->load() - value) >= 0; },
                     std::chrono::seconds(30)));

  // The next call finds the daemon gone, registers with the restarted one, and reports
  // version 1 lost (its stream-ordered wait never learnt that it was captured).
  a->Crash();
  auto process_b = std::make_unique<DaemonProcess>(ProcessOptions(dir, "b"));
  auto b = std::make_unique<FakeDaemon>(socket, "instance-b");
  b->words_pid = process_b->pid();
  CHECK_THROWS_WITH(client.snapshot(2, {}, stream),
                    Catch::Contains("daemon restarted; version 1 was not captured"));
  REQUIRE(b->registers.size() == 1);
  // Two snapshots were sent to A (1, and 2 that found it gone): B's values start above 2.
  CHECK(b->registers[0].cuda().release_base() == 2);
  CHECK(client.stream_wait() == "release words");
  client.snapshot(3, {}, stream);
  client.wait_snapshot_on_stream(3, stream);
  REQUIRE(seam.log->word_waits.size() == 2);
  // The same page: B's slot for version 3 (the fake daemon's slot is the version % 64).
  const std::atomic<std::uint32_t>* word3 = seam.log->word_waits[1].first;
  CHECK(word3 == word + 2);
  CHECK(seam.log->word_waits[1].second == 3);
  // The release of A's waits (every word holds 1, the floor when A died) does not satisfy B's.
  CHECK(word3->load() == 1);
  CHECK(static_cast<std::int32_t>(word3->load() - 3u) < 0);
  client.unregister();
}

TEST_CASE("stream-ordered waits use the daemon's events where the release words cannot be used",
          "[restart][gpu]") {
  TempDir dir("gpu-events");
  const std::string socket = dir.path() + "/ckptd.sock";
  FakeCudaSeam seam;
  auto a = std::make_unique<FakeDaemon>(socket, "instance-a");
  std::string expected;
  SECTION("the daemon does not write them") { expected = "daemon events: ckptd does not write them"; }
  SECTION("the daemon runs in another PID namespace") {
    a->words_pid = ::getpid();
    a->words_namespace = "pid:[1]";
    expected = "daemon events: ckptd's process cannot be watched: ckptd runs in PID namespace pid:[1]";
  }
  Client client = Client::connect(socket);
  CHECK(client.stream_wait().rfind("none: ", 0) == 0);
  static float device_memory[256];
  client.register_items("gpu", 0, 1, {{"w", DType::kF32, {256}, nullptr, 0, device_memory}});
  INFO(client.stream_wait());
  CHECK(client.stream_wait().rfind(expected, 0) == 0);
  void* stream = reinterpret_cast<void*>(0x5);
  client.snapshot(1, {}, stream);
  client.wait_snapshot_on_stream(1, stream);
  CHECK(seam.log->word_waits.empty());
  CHECK(seam.log->waited == std::vector<std::uint32_t>{1});
  client.unregister();
}
