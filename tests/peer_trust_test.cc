// What a daemon trusts of its peers: nothing that does not prove it knows --peer-secret.
// Each case is built as an attacker on a node would build it: a process of its own (here a
// fake Peer server in the test, support/fake_peer.h) listening on a peer's address while that
// peer's ckptd is down, without the secret. See docs/ops/replication-security.md.
#include <arpa/inet.h>
#include <ckpt/client.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/v1/peer.grpc.pb.h"
#include "common/unique_fd.h"
#include "daemon/base/peer_secret.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/fake_peer.h"
#include "support/peer_cluster.h"
#include "support/shard_path.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

// The value of one series of the daemon's metrics (GetMetrics), 0 if it is not there.
double Metric(const DaemonProcess& d, const std::string& series) {
  grpc::ClientContext ctx;
  v1::GetMetricsReply reply;
  if (!d.Stub()->GetMetrics(&ctx, v1::GetMetricsRequest(), &reply).ok()) return -1;
  std::istringstream in(reply.text());
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return 0;
}

}  // namespace

TEST_CASE("an impostor on a peer's address does not acknowledge replicas: wait_durable(replicated) fails",
          "[replication][peer_trust]") {
  TempDir dir("trustack");
  Cluster c(dir, 2, 1);
  c.Start(0);
  FakePeer impostor(c.addresses[1], {});  // node 1's ckptd is down; someone else took its port
  Job job("trustack", 2);                 // both ranks on node 0, replicated to node 1
  job.Launch(c);
  for (auto& r : job.ranks) {
    r->state.Fill(1);
    r->client->snapshot(1);
  }
  for (auto& r : job.ranks) r->client->wait_durable(1, Level::kCommitted);
  for (auto& r : job.ranks) {
    try {
      r->client->wait_durable(1, Level::kReplicated);
      FAIL("wait_durable(replicated) returned although the only peer is an impostor");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("is held by 0 of 1 peers"));
      CHECK_THAT(e.what(), Catch::Contains("did not prove it knows --peer-secret"));
    }
  }
  auto s = c[0].Status();
  CHECK(s.replicated_shards() == 0);
  CHECK(s.replication_failures() >= 2);
  CHECK_THAT(c[0].Log(), Catch::Contains("did not prove it knows --peer-secret"));
  CHECK(Metric(c[0], "ckptd_replication_events_total{event=\"unproven\"}") >= 2);
}

TEST_CASE("a restore does not take an impostor's forged shard: the persistent copy serves, and the error says why",
          "[replication][peer_trust]") {
  TempDir dir("trustget");
  Cluster c(dir, 2, 1);
  c.StartAll();
  Job job("trustget", 4);  // ranks 0, 1 on node 0 (replicated to node 1), 2, 3 on node 1
  job.Launch(c);
  job.Save(1);
  job.ranks.clear();
  // Node 0 is lost and replaced; node 1's ckptd goes down and an impostor takes its port,
  // claiming it holds node 0's replicas: shards with the right names, every checksum
  // recomputed, and every data byte changed.
  c.Lose(0);
  c.daemons[1]->Kill9();
  FakePeer impostor(c.addresses[1], {});
  for (std::uint32_t r : {0u, 1u}) {
    const std::string genuine = ShardPath(c.root(), job.name, 1, r);
    auto info = ReadShardHeader(genuine);
    REQUIRE(info.ok());
    impostor.Hold(job.name, 1, r, ForgedShard(genuine), info->meta.session);
  }
  c.Start(0);
  for (std::uint32_t r : {0u, 1u}) {
    job.ranks.push_back(std::make_unique<Rank>(r));
    job.ranks.back()->Connect(c.socket(0), job.name, job.world);
  }
  auto tiers = job.RestoreAll(1);  // byte-exact: the good copy
  CHECK(tiers[0] == "persistent");
  CHECK(tiers[1] == "persistent");
  auto s = c[0].Status();
  CHECK(s.restored_bytes_peer() == 0);
  CHECK(s.restored_bytes_persistent() == 2 * kTensors * kTensorBytes);
  CHECK_THAT(ErrorsOf(s), Catch::Contains("peer " + c.addresses[1]) &&
                              Catch::Contains("did not prove it knows --peer-secret"));
  CHECK(impostor.get_calls() == 0);  // its claim to hold the shard was not believed
  CHECK(Metric(c[0], "ckptd_replication_events_total{event=\"unproven\"}") >= 2);
}

namespace {

// The shard of `rank` of version 1 as the persistent tier holds it, changed by `change`
// (identity and items, as ReadShardHeader gave them), with the genuine bytes of the items
// that keep their names and zeros for new ones, every checksum recomputed.
std::string Changed(const Cluster& c, const std::string& job, std::uint32_t rank,
                    const std::function<void(ShardInfo&)>& change, std::string* registration) {
  const std::string path = ShardPath(c.root(), job, 1, rank);
  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  ShardInfo changed = info.value();
  change(changed);
  *registration = changed.meta.session;
  return RebuildShard(changed, [&](const ShardItem& item, char* out) {
    std::memset(out, 0, item.length);
    for (const ShardItem& genuine : info->items) {
      if (genuine.name != item.name) continue;
      const std::string bytes = ReadShardItem(path, genuine.name);
      std::memcpy(out, bytes.data(), std::min<std::size_t>(bytes.size(), item.length));
    }
  });
}

// Saves version 1 of a job of 4 ranks on two nodes, then loses node 0, and node 1's daemon
// goes down (the caller puts a fake peer on its address).
void LoseBothNodes(Cluster& c, Job& job) {
  c.StartAll();
  job.Launch(c);
  job.Save(1);
  job.ranks.clear();
  c.Lose(0);
  c.daemons[1]->Kill9();
}

// Node 0's replacement, and its two ranks connected to it.
void RelaunchNode0(Cluster& c, Job& job) {
  c.Start(0);
  for (std::uint32_t r : {0u, 1u}) {
    job.ranks.push_back(std::make_unique<Rank>(r));
    job.ranks.back()->Connect(c.socket(0), job.name, job.world);
  }
}

}  // namespace

TEST_CASE("a peer's copy that names the right shard but does not fit the registration is passed over",
          "[replication][peer_trust]") {
  TempDir dir("trustfit");
  Cluster c(dir, 2, 1);
  Job job("trustfit", 4);
  LoseBothNodes(c, job);
  // A peer that knows the secret (its proofs and MACs are right) holds copies of version 1
  // of ranks 0 and 1 that are not this registration's.
  PeerSecret secret("a shared secret of the test cluster");
  std::function<void(ShardInfo&)> change;
  std::string what;
  SECTION("another world size") {
    change = [](ShardInfo& info) { info.meta.world_size = 8; };
    what = "rank 0 of 8";
  }
  SECTION("an extra item") {
    change = [](ShardInfo& info) {
      ShardItem extra;
      extra.name = "extra";
      extra.dtype = DType::kU8;
      extra.shape = {4096};
      extra.length = 4096;
      info.items.push_back(extra);
    };
    what = "did not register";
  }
  SECTION("another shape") {
    change = [](ShardInfo& info) {
      ShardItem& t = info.items.front();
      t.shape = {2, t.shape.at(0) / 2};
    };
    what = "has shape [2, ";
  }
  FakePeer peer(c.addresses[1], FakePeer::Options{&secret, false});
  for (std::uint32_t r : {0u, 1u}) {
    std::string registration;
    std::string file = Changed(c, job.name, r, change, &registration);
    peer.Hold(job.name, 1, r, std::move(file), registration);
  }
  RelaunchNode0(c, job);
  auto tiers = job.RestoreAll(1);  // byte-exact, from the persistent tier
  CHECK(tiers[0] == "persistent");
  CHECK(tiers[1] == "persistent");
  CHECK(peer.get_calls() >= 2);  // it was asked, and passed over
  CHECK_THAT(ErrorsOf(c[0].Status()), Catch::Contains("the replica from peer " + c.addresses[1] +
                                                      " does not fit this registration") &&
                                          Catch::Contains(what));
}

TEST_CASE("a peer that sends a shard's header and stalls is given up within the progress timeout",
          "[replication][peer_trust]") {
  TempDir dir("truststall");
  Cluster c(dir, 2, 1);
  c.extra_args = {"--peer-progress-timeout-s", "2"};
  Job job("truststall", 4);
  LoseBothNodes(c, job);
  PeerSecret secret("a shared secret of the test cluster");
  FakePeer peer(c.addresses[1], FakePeer::Options{&secret, /*stall_after_first_piece=*/true});
  for (std::uint32_t r : {0u, 1u}) {
    std::string registration;
    std::string file = Changed(c, job.name, r, [](ShardInfo&) {}, &registration);
    peer.Hold(job.name, 1, r, std::move(file), registration);
  }
  RelaunchNode0(c, job);
  const auto start = std::chrono::steady_clock::now();
  auto tiers = job.RestoreAll(1);
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(tiers[0] == "persistent");
  CHECK(tiers[1] == "persistent");
  CHECK(peer.get_calls() == 2);
  // Two ranks, each given up after 2 s without a byte (not the call's 5-minute deadline).
  CHECK(took < std::chrono::seconds(20));
  CHECK_THAT(ErrorsOf(c[0].Status()), Catch::Contains("peer " + c.addresses[1] + " moved no byte for 2 s"));
  CHECK(Metric(c[0], "ckptd_replication_events_total{event=\"peer_stalled\"}") == 2);
}

TEST_CASE("many idle connections to a peer port do not stop the daemon serving its trainers",
          "[replication][peer_trust]") {
  TempDir dir("trustflood");
  Cluster c(dir, 2, 1);
  c.open_files = 512;  // so that the flood below is more than the daemon's descriptors
  c.StartAll();
  // Someone on the node opens connections to node 0's peer port and never makes a call.
  const std::string port = c.addresses[0].substr(c.addresses[0].rfind(':') + 1);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 700; ++i) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(fd.valid());
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(std::stoi(port)));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) idle.push_back(std::move(fd));
  }
  CHECK(idle.size() >= 600);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the daemon has seen them all
  // Node 0's trainers are served: register, save (committed and replicated to node 1), restore.
  Job job("trustflood", 2);
  job.Launch(c);
  job.Save(1);
  auto tiers = job.RestoreAll(1);
  CHECK(tiers[0] == "memory");
  CHECK(Eventually([&] { return c[0].Log().find("--peer-max-connections-per-address") != std::string::npos; }));
}

namespace {

int ThreadsOf(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

}  // namespace

TEST_CASE("GetShard streams without a token that never send their request are refused at once, holding no thread",
          "[replication][peer_trust]") {
  TempDir dir("trustthreads");
  Cluster c(dir, 2, 1);
  c.Start(0);
  const int before = ThreadsOf(c[0].pid());
  // Someone opens GetShard calls to node 0's peer port: metadata only, no token, and never
  // the request.
  grpc::GenericStub stub(grpc::CreateChannel(c.addresses[0], grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  struct Call {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream;
    grpc::Status status;
    bool finished = false;
  };
  constexpr int kCalls = 100;
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<Call>());
    Call& call = *calls.back();
    call.stream = stub.PrepareCall(&call.ctx, "/ckpt.v1.Peer/GetShard", &cq);
    call.stream->StartCall(reinterpret_cast<void*>(2 * i));
    call.stream->Finish(&call.status, reinterpret_cast<void*>(2 * i + 1));
  }
  // Every call ends on its own, refused, within seconds.
  int finished = 0;
  const auto until = std::chrono::system_clock::now() + std::chrono::seconds(10);
  void* tag = nullptr;
  bool ok = false;
  int events = 0;
  while (events < 2 * kCalls && cq.AsyncNext(&tag, &ok, until) == grpc::CompletionQueue::GOT_EVENT) {
    ++events;
    const auto t = reinterpret_cast<std::uintptr_t>(tag);
    if (t % 2 == 1) {
      calls[t / 2]->finished = true;
      ++finished;
    }
  }
  const int during = ThreadsOf(c[0].pid());
  CHECK(finished == kCalls);
  // Refused for want of a token, or, past the server's 64-thread quota (a loaded machine
  // runs the refusals slower than they arrive), refused for want of a thread: both without
  // holding one.
  for (const auto& call : calls) {
    if (!call->finished) continue;
    INFO(call->status.error_message());
    CHECK((call->status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
           call->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED));
  }
  // A burst of refusals may start a few server threads at once (CI once saw 15 above the
  // start, 57 against 42): they end when the burst is over. A thread held by each refused
  // call would not, and the count would stay up by about the number of calls.
  INFO("daemon threads before the calls " << before << ", once they were refused " << during);
  CHECK(Eventually([&] { return ThreadsOf(c[0].pid()) < before + 20; }, std::chrono::seconds(20)));
  // The calls left (none, once refused at once) are cancelled and drained.
  for (const auto& call : calls) {
    if (!call->finished) call->ctx.TryCancel();
  }
  while (events < 2 * kCalls && cq.Next(&tag, &ok)) ++events;
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_CASE("a flood of refused peer calls is logged a line a second, not a line a call", "[replication][peer_trust]") {
  TempDir dir("trustlog");
  Cluster c(dir, 2, 1);
  c.Start(0);
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(c.addresses[0], grpc::InsecureChannelCredentials()));
  PeerSecret wrong("not the secret of this cluster at all");
  constexpr int kCalls = 200;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext ctx;
    const std::string subject = PeerSecret::ShardSubject("trustlog", 1, 0, "");
    ctx.AddMetadata(PeerSecret::kMetadataKey, wrong.Token("HasShard", PeerSecret::Addressed(subject, c.addresses[0])));
    v1::HasShardRequest req;
    req.mutable_key()->set_job("trustlog");
    req.mutable_key()->set_version(1);
    v1::HasShardReply reply;
    CHECK(stub->HasShard(&ctx, req, &reply).error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  const std::string log = c[0].Log();
  std::size_t lines = 0;
  for (std::size_t at = log.find("peer: refused a call"); at != std::string::npos;
       at = log.find("peer: refused a call", at + 1)) {
    ++lines;
  }
  CHECK(lines >= 1);
  CHECK(lines <= 10);  // the calls took a few seconds at most
  CHECK(Metric(c[0], "ckptd_replication_events_total{event=\"refused\"}") == kCalls);  // each one counted
}
