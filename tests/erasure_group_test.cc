// Erasure-coded peer redundancy (ckptd --erasure K+M), with real ckptd processes on loopback
// TCP standing for the nodes of a job (support/peer_cluster.h): a lost node's shards rebuilt
// from the rest of its group, byte-exact; corrupt parity found by its checksum; the flags.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "ckpt/v1/peer.grpc.pb.h"
#include "daemon/base/peer_secret.h"
#include "daemon/replication/parity_store.h"
#include "format/checksum.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/peer_cluster.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

// Saves `v` on every rank and waits until it is committed and every node sent the chunks of
// its shards of it to their holders (`chunks_each`: each node's count of chunks sent by then).
void SaveProtected(Cluster& c, Job& job, std::uint64_t v, std::uint64_t chunks_each) {
  job.Snapshot(v);
  for (auto& r : job.ranks) r->client->wait_durable(v, Level::kCommitted);
  for (int i = 0; i < static_cast<int>(c.daemons.size()); ++i) {
    INFO("node " << i);
    REQUIRE(Eventually([&] {
      auto st = c[i].Status();
      return st.erasure_chunks_sent() + st.erasure_send_failures() >= chunks_each;
    }));
    CHECK(c[i].Status().erasure_send_failures() == 0);
  }
}

}  // namespace

TEST_CASE("erasure 4+1 over 5 nodes: a lost node's shards are rebuilt from the other four, byte-exact, with a "
          "quarter of a replica's memory, and protection resumes with the replacement",
          "[erasure]") {
  TempDir dir("ec41");
  Cluster c(dir, 5, 0);
  c.extra_args = {"--erasure", "4+1"};
  c.StartAll();
  Job job("ec41", 10);
  job.Launch(c);
  // Each node publishes 2 shards a version, cut in 4 chunks, each sent to 1 holder.
  for (std::uint64_t v = 1; v <= 3; ++v) SaveProtected(c, job, v, v * 2 * 4);
  // Each node holds parity for the versions the memory tiers keep (--memory-versions 1: the
  // newest committed one) of its 2 slots, one stripe each, of a quarter of a shard: a
  // quarter of what full replicas of the same shards take (2 ranks x 1 version x a shard).
  const double shard = static_cast<double>(kTensors * kTensorBytes);
  const double replica = 2 * 1 * shard;
  for (int i = 0; i < 5; ++i) {
    INFO("node " << i << ": " << c[i].Status().erasure());
    CHECK_THAT(c[i].Status().erasure(), Catch::Contains("4+1, position " + std::to_string(i)));
    // The older versions' parity goes once the holder has seen the newest commit.
    CHECK(Eventually([&] { return static_cast<double>(c[i].Status().erasure_parity_bytes()) <= 0.26 * replica; }));
    CHECK(static_cast<double>(c[i].Status().erasure_parity_bytes()) >= 0.25 * replica);
  }

  c.Lose(2);
  c.Start(2);  // the replacement node: empty memory
  job.Launch(c);
  auto tiers = job.RestoreAll(3);
  for (std::uint32_t r = 0; r < job.world; ++r) {
    INFO("rank " << r);
    CHECK(tiers[r] == (job.NodeOf(r) == 2 ? "peer" : "memory"));
  }
  auto fresh = c[2].Status();
  CHECK(fresh.erasure_rebuilds() == 2);
  CHECK(fresh.erasure_rebuild_failures() == 0);
  CHECK(fresh.restored_bytes_persistent() == 0);
  CHECK(fresh.bytes_read_total() == 0);  // no file read at all
  // What the operator sees: ckptctl status and the metrics.
  ProcessResult text = RunProcess({CKPTCTL_BINARY, "--socket", c.socket(2), "status"});
  CHECK_THAT(text.output, Catch::Contains("erasure coding: 4+1, position 2 of the group"));
  CHECK_THAT(text.output, Catch::Contains("2 shard(s) rebuilt from the group, 0 rebuild(s) failed"));
  CHECK(Metric(c.socket(2), "ckptd_erasure_events_total{event=\"rebuilt\"}") == 2);
  CHECK(Metric(c.socket(2), "ckptd_erasure_events_total{event=\"rebuild_failed\"}") == 0);
  CHECK(Metric(c.socket(0), "ckptd_erasure_parity_bytes") > 0);

  // Training goes on; the replacement holds its part again, so the next loss is rebuilt too.
  std::vector<std::uint64_t> sent(5);
  for (int i = 0; i < 5; ++i) sent[i] = c[i].Status().erasure_chunks_sent();
  job.Snapshot(4);
  for (auto& r : job.ranks) r->client->wait_durable(4, Level::kCommitted);
  for (int i = 0; i < 5; ++i) {
    REQUIRE(Eventually([&] { return c[i].Status().erasure_chunks_sent() >= sent[i] + 8; }));
  }
  c.Lose(3);
  c.Start(3);
  job.Launch(c);
  tiers = job.RestoreAll(4);
  for (std::uint32_t r = 0; r < job.world; ++r) {
    INFO("rank " << r);
    CHECK(tiers[r] == (job.NodeOf(r) == 3 ? "peer" : "memory"));
  }
  CHECK(c[3].Status().erasure_rebuilds() == 2);
  CHECK(c[3].Status().restored_bytes_persistent() == 0);
}

TEST_CASE("erasure 3+2: two nodes lost at once are both rebuilt from the other three", "[erasure]") {
  TempDir dir("ec32");
  Cluster c(dir, 5, 0);
  c.extra_args = {"--erasure", "3+2"};
  c.StartAll();
  Job job("ec32", 10);
  job.Launch(c);
  // 2 shards a version, 3 chunks each, each to 2 holders.
  for (std::uint64_t v = 1; v <= 2; ++v) SaveProtected(c, job, v, v * 2 * 3 * 2);
  c.Lose(1);
  c.Lose(4);
  c.Start(1);
  c.Start(4);
  job.Launch(c);
  auto tiers = job.RestoreAll(2);
  for (std::uint32_t r = 0; r < job.world; ++r) {
    INFO("rank " << r);
    const int node = job.NodeOf(r);
    CHECK(tiers[r] == (node == 1 || node == 4 ? "peer" : "memory"));
  }
  for (int i : {1, 4}) {
    auto st = c[i].Status();
    CHECK(st.erasure_rebuilds() == 2);
    CHECK(st.restored_bytes_persistent() == 0);
  }
}

TEST_CASE("corrupt parity is found by its checksum: the rebuild fails naming it, and the restore reads the "
          "persistent tier, byte-exact",
          "[erasure]") {
  TempDir dir("eccorrupt");
  Cluster c(dir, 5, 0);
  c.extra_args = {"--erasure", "4+1"};
  for (auto& e : c.env) e = {"CKPTD_TEST_CORRUPT_PARITY=1"};  // every holder serves a flipped byte
  c.StartAll();
  Job job("eccorrupt", 10);
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 2; ++v) SaveProtected(c, job, v, v * 2 * 4);
  c.Lose(1);
  c.Start(1);
  job.Launch(c);
  auto tiers = job.RestoreAll(2);  // byte-exact, checked there
  for (std::uint32_t r = 0; r < job.world; ++r) {
    INFO("rank " << r);
    CHECK(tiers[r] == (job.NodeOf(r) == 1 ? "persistent" : "memory"));
  }
  auto st = c[1].Status();
  CHECK(st.erasure_rebuilds() == 0);
  CHECK(st.erasure_rebuild_failures() == 2);
  CHECK(st.erasure_corrupt_fragments() >= 2);
  CHECK_THAT(ErrorsOf(st), Catch::Contains("does not match its checksum (corrupt)"));
  CHECK(st.restored_bytes_persistent() == 2 * kTensors * kTensorBytes);
  CHECK(Metric(c.socket(1), "ckptd_erasure_events_total{event=\"corrupt\"}") >= 2);
  // The other daemons serve on, and the job goes on protected.
  SaveProtected(c, job, 3, 0);
}

TEST_CASE("erasure and replicas together: the replica is read first, the group rebuilds when the replica is bad",
          "[erasure]") {
  TempDir dir("ecrepl");
  Cluster c(dir, 5, 1);
  c.extra_args = {"--erasure", "4+1"};
  c.env[3] = {"CKPTD_TEST_CORRUPT_REPLICAS=1"};  // node 3 keeps node 2's replicas corrupt
  c.StartAll();
  Job job("ecrepl", 10);
  job.Launch(c);
  auto save = [&](std::uint64_t v) {
    std::vector<std::uint64_t> sent(5);
    for (int i = 0; i < 5; ++i) sent[i] = c[i].Status().erasure_chunks_sent();
    job.Save(v);  // committed and replicated
    for (int i = 0; i < 5; ++i) REQUIRE(Eventually([&] { return c[i].Status().erasure_chunks_sent() >= sent[i] + 8; }));
  };
  save(1);
  save(2);
  // Node 0's replicas (on node 1) are intact: read first, nothing rebuilt.
  c.Lose(0);
  c.Start(0);
  job.Launch(c);
  auto tiers = job.RestoreAll(2);
  for (std::uint32_t r = 0; r < job.world; ++r) CHECK(tiers[r] == (job.NodeOf(r) == 0 ? "peer" : "memory"));
  CHECK(c[0].Status().erasure_rebuilds() == 0);
  save(3);
  // Node 2's replicas (on node 3) fail their checks: the group rebuilds its shards.
  c.Lose(2);
  c.Start(2);
  job.Launch(c);
  tiers = job.RestoreAll(3);
  for (std::uint32_t r = 0; r < job.world; ++r) CHECK(tiers[r] == (job.NodeOf(r) == 2 ? "peer" : "memory"));
  auto st = c[2].Status();
  CHECK(st.erasure_rebuilds() == 2);
  CHECK(st.restored_bytes_persistent() == 0);
}

TEST_CASE("a restore that leaves the timeline above it drops the group's parity there: the new timeline's "
          "version is rebuilt, never the old one's",
          "[erasure]") {
  TempDir dir("ectimeline");
  Cluster c(dir, 5, 0);
  c.extra_args = {"--erasure", "4+1"};
  c.StartAll();
  Job job("ectimeline", 10);
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 2; ++v) SaveProtected(c, job, v, v * 2 * 4);
  // Node 1 is lost; the others snapshot version 3, which cannot commit, and send its chunks.
  c.Lose(1);
  std::vector<std::uint64_t> sent(5);
  for (int i : {0, 2, 3, 4}) sent[i] = c[i].Status().erasure_chunks_sent();
  for (auto& r : job.ranks) {
    if (job.NodeOf(r->rank) == 1) continue;
    r->state.Fill(3);
    r->client->snapshot(3);
  }
  for (int i : {0, 2, 3, 4}) {
    REQUIRE(Eventually([&] {
      auto st = c[i].Status();
      return st.erasure_chunks_sent() + st.erasure_send_failures() >= sent[i] + 8;
    }));
  }
  // The job restarts on a replacement of node 1 and restores version 2 (node 1's ranks rebuilt
  // from the group); its own version 3 (other contents) commits.
  c.Start(1);
  job.Launch(c);
  auto tiers = job.RestoreAll(2);
  for (std::uint32_t r = 0; r < job.world; ++r) CHECK(tiers[r] == (job.NodeOf(r) == 1 ? "peer" : "memory"));
  for (int i = 0; i < 5; ++i) sent[i] = c[i].Status().erasure_chunks_sent();
  for (auto& r : job.ranks) {
    r->state.Fill(303);
    r->client->snapshot(3);
  }
  for (auto& r : job.ranks) r->client->wait_durable(3, Level::kCommitted);
  for (int i = 0; i < 5; ++i) REQUIRE(Eventually([&] { return c[i].Status().erasure_chunks_sent() >= sent[i] + 8; }));
  // Node 4 lost: its ranks' version 3 is the new timeline's.
  c.Lose(4);
  c.Start(4);
  job.Launch(c);
  for (auto& r : job.ranks) {
    INFO("rank " << r->rank);
    r->state.Fill(999);
    RestoreResult got = r->client->restore();
    REQUIRE(got.version == 3);
    CHECK(r->state.FirstMismatch(303) == -1);
    CHECK(got.tier == (job.NodeOf(r->rank) == 4 ? "peer" : "memory"));
  }
  CHECK(c[4].Status().erasure_rebuilds() == 2);
}

TEST_CASE("a PutChunk without the secret, for another chunk than its token's, with a bad MAC or to a daemon "
          "holding no row of its stripe is refused, and nothing is folded",
          "[erasure]") {
  TempDir dir("ecput");
  Cluster c(dir, 5, 0);
  c.extra_args = {"--erasure", "4+1"};
  c.Start(0);
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(c.addresses[0], grpc::InsecureChannelCredentials()));
  // Stripe 0's parity is held by daemon 0; its data position 0 is daemon 1.
  v1::StripeMember m;
  m.set_job("ecput");
  m.set_version(1);
  m.set_stripe(0);
  m.set_position(0);
  m.set_origin(c.addresses[1]);
  m.set_file_bytes(256);
  m.set_chunk_bytes(64);
  const std::string chunk(64, 'x');
  m.set_chunk_xxh3(Checksum::Of(chunk.data(), chunk.size()));
  auto put = [&](const PeerSecret& secret, const std::string& subject, const v1::StripeMember& member,
                 bool good_mac) {
    grpc::ClientContext ctx;
    const std::string token = secret.Token("PutChunk", PeerSecret::Addressed(subject, c.addresses[0]));
    ctx.AddMetadata(PeerSecret::kMetadataKey, token);
    ctx.AddMetadata(PeerSecret::kSubjectKey, subject);
    v1::PutChunkReply reply;
    auto writer = stub->PutChunk(&ctx, &reply);
    v1::ChunkPiece piece;
    *piece.mutable_member() = member;
    piece.set_data(chunk);
    piece.set_last(true);
    PeerSecret::ImageMac mac = secret.StartImage();
    mac.Update(chunk.data(), chunk.size());
    piece.set_mac(good_mac ? mac.Finish(ChunkBinding("PutChunk", PeerSecret::NonceOf(token), member))
                           : std::string(PeerSecret::kMacBytes, '\0'));
    writer->Write(piece);
    writer->WritesDone();
    return writer->Finish();
  };
  const PeerSecret secret("a shared secret of the test cluster");
  const std::string subject = PeerSecret::ShardSubject("ecput", 1, 0, c.addresses[1]);
  SECTION("another secret") {
    grpc::Status st = put(PeerSecret("another secret"), subject, m, true);
    CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  SECTION("the first piece is another chunk than the token's") {
    v1::StripeMember other = m;
    other.set_job("planted");
    grpc::Status st = put(secret, subject, other, true);
    CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK_THAT(st.error_message(), Catch::Contains("names another chunk than the call's token"));
  }
  SECTION("a bad MAC") {
    grpc::Status st = put(secret, subject, m, false);
    CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK_THAT(st.error_message(), Catch::Contains("MAC does not match"));
  }
  SECTION("a stripe this daemon holds no row of") {
    v1::StripeMember other = m;
    other.set_stripe(1);
    grpc::Status st = put(secret, subject, other, true);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("holds no parity of that stripe"));
  }
  SECTION("a position that is another daemon's") {
    v1::StripeMember other = m;
    other.set_position(1);
    grpc::Status st = put(secret, subject, other, true);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("that position is another daemon's"));
  }
  SECTION("a well-formed chunk is taken") {
    CHECK(put(secret, subject, m, true).ok());
    CHECK(c[0].Status().erasure_parity_bytes() == 64);
    return;
  }
  CHECK(c[0].Status().erasure_parity_bytes() == 0);
}

TEST_CASE("erasure flags: what is missing or wrong is named, exit 2", "[erasure]") {
  TempDir dir("ecflags");
  const std::string secret = WriteSecret(dir.path() + "/s", "a shared secret of the test cluster");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {CKPTD_BINARY, "--socket", dir.path() + "/x.sock", "--root", dir.path(),
                                     "--check-config"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProcess(argv);
  };
  for (const char* bad : {"4", "4+0", "0+1", "4x1", "30+3", "4+1+1", "-1+2", "4+-1", "4294967295+2", "+1", "4+"}) {
    INFO(bad);
    auto r = run({"--erasure", bad});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--erasure '" + std::string(bad) + "': expected K+M"));
  }
  auto r = run({"--erasure", "2+2"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("M must be below K"));
  r = run({"--erasure", "4+1"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--erasure 4+1 needs --peer-listen ADDR:PORT"));
  r = run({"--erasure", "4+1", "--peer-listen", "127.0.0.1:1"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--erasure 4+1 needs --peer-secret FILE"));
  r = run({"--erasure", "4+1", "--peer-listen", "127.0.0.1:1", "--peer-secret", secret});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--erasure 4+1 needs --peers"));
  r = run({"--erasure", "2+1", "--peer-listen", "127.0.0.1:1", "--peer-secret", secret, "--peers",
           "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--peers names 4 daemons, not a multiple of K+M = 3"));
  r = run({"--erasure", "2+1", "--peer-listen", "127.0.0.1:1", "--peer-secret", secret, "--peers",
           "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "--memory-mib", "0"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--erasure 2+1 needs a memory tier"));
  r = run({"--erasure", "2+1", "--peer-listen", "127.0.0.1:1", "--peer-secret", secret, "--peers",
           "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"});
  CHECK(r.exit_code == 0);
}

TEST_CASE("erasure geometry: every stripe has each daemon once, a holder is never a data member of its stripe, "
          "and each daemon's K chunks go to K stripes",
          "[erasure]") {
  for (unsigned k = 1; k < 32; ++k) {
    for (unsigned m = 1; k + m <= 32; ++m) {
      ErasureGeometry g;
      g.k = k;
      g.m = m;
      for (unsigned s = 0; s < g.n(); ++s) {
        std::vector<int> seen(g.n(), 0);
        for (unsigned c = 0; c < k; ++c) {
          ++seen[g.DataAt(s, c)];
          REQUIRE(g.StripeOf(g.DataAt(s, c), c) == s);
        }
        for (unsigned j = 0; j < m; ++j) ++seen[g.HolderOf(s, j)];
        REQUIRE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      }
      for (unsigned p = 0; p < g.n(); ++p) {
        std::vector<int> stripes(g.n(), 0);
        for (unsigned c = 0; c < k; ++c) ++stripes[g.StripeOf(p, c)];
        REQUIRE(std::count(stripes.begin(), stripes.end(), 1) == static_cast<long>(k));
      }
    }
  }
}

TEST_CASE("parity retention follows the commits, late chunks are refused, and the cap never drops parity for "
          "nothing",
          "[erasure]") {
  ErasureGeometry g;
  g.k = 4;
  g.m = 1;
  g.members = {"a:1", "b:1", "c:1", "d:1", "e:1"};
  g.self = 0;  // holds stripe 0, whose data positions are b, c, d, e
  auto code = ErasureCode::Create(4, 1);
  REQUIRE(code.ok());
  auto member = [&](const std::string& job, std::uint64_t version, std::uint64_t file_bytes) {
    v1::StripeMember m;
    m.set_job(job);
    m.set_version(version);
    m.set_stripe(0);
    m.set_position(0);
    m.set_origin("b:1");
    m.set_file_bytes(file_bytes);
    m.set_chunk_bytes(StripeFragmentBytes(file_bytes, 4));
    return m;
  };
  std::vector<std::uint8_t> chunk(1 << 20, 7);
  SECTION("retention") {
    ParityStore store(std::move(code).value(), g, 1, std::uint64_t{1} << 30, false);
    for (std::uint64_t v = 1; v <= 20; ++v) REQUIRE(store.Fold(member("j", v, 256), chunk.data()).ok());
    CHECK(store.stripes() == ParityStore::kUncommittedKept);  // nothing committed yet: the newest 16
    store.OnCommitted("j", 18);
    CHECK(store.stripes() == 3);  // 18, and 19 and 20 above it
    CHECK(store.Fold(member("j", 10, 256), chunk.data()).code() == StatusCode::kFailedPrecondition);
    for (std::uint64_t v = 21; v <= 40; ++v) REQUIRE(store.Fold(member("j", v, 256), chunk.data()).ok());
    // The newest committed version stays, whatever comes above it.
    CHECK(store.Find("j", 18, 0, "b:1", 0).has_value());
    CHECK(store.stripes() == 1 + ParityStore::kUncommittedKept);
    // Another chunk at a folded place (a version written again) starts the stripe over.
    v1::StripeMember again = member("j", 40, 256);
    again.set_chunk_xxh3(1);
    REQUIRE(store.Fold(again, chunk.data()).ok());
    CHECK(store.Find("j", 40, 0, "b:1", 0)->members[0].chunk_xxh3() == 1);
    // A member at a position that is another daemon's, or a stripe this one holds no row of.
    v1::StripeMember wrong = member("j", 41, 256);
    wrong.set_origin("c:1");
    CHECK(store.Fold(wrong, chunk.data()).code() == StatusCode::kInvalidArgument);
    wrong = member("j", 41, 256);
    wrong.set_stripe(1);
    CHECK(store.Fold(wrong, chunk.data()).code() == StatusCode::kInvalidArgument);
  }
  SECTION("cap") {
    const std::uint64_t row = StripeFragmentBytes(4096, 4);  // 1024
    ParityStore store(std::move(code).value(), g, 1, 2 * row, false);
    REQUIRE(store.Fold(member("old", 1, 4096), chunk.data()).ok());
    REQUIRE(store.Fold(member("new", 1, 4096), chunk.data()).ok());
    CHECK(store.parity_bytes() == 2 * row);
    // Too big even with every other job dropped: refused, nothing dropped.
    CHECK(store.Fold(member("new", 2, 4 * 4096), chunk.data()).code() == StatusCode::kResourceExhausted);
    CHECK(store.Find("old", 1, 0, "b:1", 0).has_value());
    // Room from the job folded into least recently.
    REQUIRE(store.Fold(member("new", 2, 4096), chunk.data()).ok());
    CHECK_FALSE(store.Find("old", 1, 0, "b:1", 0).has_value());
    CHECK(store.parity_bytes() == 2 * row);
  }
}
