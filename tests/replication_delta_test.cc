// Differential replicas (DESIGN-NOTES.md, "Differential replicas"): a version whose items
// mostly did not change goes to a peer that holds an older version as a delta, and the peer
// composes it from its replica; what it cannot trust is refused. With real ckptd processes
// (support/peer_cluster.h) and, for the receiver's checks, ReceiveImage itself.
#include <ckpt/client.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "daemon/base/peer_secret.h"
#include "daemon/replication/piece_wire.h"
#include "daemon/replication/shard_stream.h"
#include "format/checksum.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/peer_cluster.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

// ---- ReceiveImage composing from a base ----

constexpr const char* kOrigin = "10.0.0.2:7000";
constexpr const char* kNonce = "0123456789abcdef";

std::string Pattern(std::size_t n, unsigned seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + 7 + seed * 29) % 251);
  return s;
}

// A shard file of `meta` whose items t0, t1, ... hold `contents`.
std::string ShardFile(const ShardMeta& meta, const std::vector<std::string>& contents,
                      const std::vector<std::string>& names = {}) {
  std::vector<ShardItem> planned(contents.size());
  for (std::size_t i = 0; i < contents.size(); ++i) {
    planned[i].name = names.empty() ? "t" + std::to_string(i) : names[i];
    planned[i].dtype = DType::kU8;
    planned[i].length = contents[i].size();
    planned[i].shape = {static_cast<std::int64_t>(contents[i].size())};
  }
  auto layout = ShardLayout::Plan(meta, planned);
  REQUIRE(layout.ok());
  std::string file(layout->file_bytes(), '\0');
  for (std::size_t i = 0; i < contents.size(); ++i) {
    ShardItem& item = layout->items()[i];
    std::memcpy(file.data() + layout->header_bytes() + item.offset, contents[i].data(), contents[i].size());
    item.checksum = Checksum::Of(contents[i].data(), contents[i].size());
  }
  const std::string header = layout->RenderHeader();
  std::memcpy(file.data(), header.data(), header.size());
  return file;
}

// An image (outside any tier) holding `file`, or room for `file_bytes`.
std::shared_ptr<MemoryImage> Image(const ShardMeta& meta, std::uint64_t file_bytes,
                                   const std::string& file = "") {
  auto buffer = std::make_shared<std::vector<char>>(file_bytes);
  if (!file.empty()) std::memcpy(buffer->data(), file.data(), file.size());
  auto image = std::shared_ptr<MemoryImage>(new MemoryImage(meta, file_bytes, buffer->data(), file_bytes),
                                            [buffer](MemoryImage* p) { delete p; });
  image->complete = true;
  return image;
}

std::vector<ItemSpan> SpansOf(const std::string& file, const ShardMeta& meta) {
  auto image = Image(meta, file.size(), file);
  auto info = ImageHeader(*image);
  REQUIRE(info.ok());
  return ItemSpans(info.value());
}

std::uint64_t HeaderEndOf(const std::string& file, const ShardMeta& meta) {
  auto image = Image(meta, file.size(), file);
  auto info = ImageHeader(*image);
  REQUIRE(info.ok());
  return info->data_start;
}

// What a sender puts on the wire for `image` with `plan`, its MAC bound to `mac_base`.
std::vector<grpc::ByteBuffer> Pieces(const PeerSecret& secret, const std::shared_ptr<MemoryImage>& image,
                                     const DeltaPlan& plan, std::uint64_t mac_base,
                                     std::uint64_t piece = 64 << 10) {
  std::vector<grpc::ByteBuffer> out;
  const ShardMeta& m = image->meta;
  const std::string binding = PeerSecret::ImageBinding("PutShard", kNonce, m.job, m.version, m.rank,
                                                       m.session, kOrigin, image->file_bytes, mac_base);
  REQUIRE(SendImage(
      image, kOrigin, piece, PieceSums::kChecked, secret.StartImage(), binding,
      [&](const grpc::ByteBuffer& p, std::uint64_t) {
        out.push_back(p);
        return true;
      },
      nullptr, plan));
  return out;
}

// ReceiveImage of `pieces` with `base` as the replica the receiver holds (null: none).
Result<std::shared_ptr<MemoryImage>> Receive(const PeerSecret& secret,
                                             const std::vector<grpc::ByteBuffer>& pieces,
                                             const std::shared_ptr<MemoryImage>& base,
                                             std::uint64_t* received, bool room = true) {
  auto first = WirePiece::Parse(pieces.at(0));
  REQUIRE(first.ok());
  std::size_t next = 1;
  return ReceiveImage(
      first.value(),
      [&](grpc::ByteBuffer* b) {
        if (next == pieces.size()) return false;
        *b = pieces[next++];
        return true;
      },
      [room](const ShardMeta& meta, std::uint64_t file_bytes, std::string* why) -> std::shared_ptr<MemoryImage> {
        if (!room) {
          *why = "no room";
          return nullptr;
        }
        return Image(meta, file_bytes);
      },
      v1::ShardKey(), PieceSums::kChecked, ImageCheck{&secret, "PutShard", kNonce, ""}, received,
      [&](std::uint64_t version, std::string* why) -> std::shared_ptr<MemoryImage> {
        if (!base || base->meta.version != version) {
          *why = "no such replica";
          return nullptr;
        }
        return base;
      });
}

// ---- the cluster ----

constexpr std::size_t kFrozenTensors = 18;  // never change after version 1
constexpr std::size_t kLiveTensors = 2;     // change every version
constexpr std::size_t kDeltaTensorBytes = 256 << 10;

// A fine-tuning rank: most of its tensors frozen (the content of version 1 forever), a few
// trained (the content of the version saved).
struct FineTuneRank {
  std::uint32_t rank;
  TrainerState frozen, live;
  std::unique_ptr<Client> client;
  explicit FineTuneRank(std::uint32_t r)
      : rank(r),
        frozen(kFrozenTensors, kDeltaTensorBytes, 300 + r),
        live(kLiveTensors, kDeltaTensorBytes, 400 + r) {}
  void Connect(const std::string& socket, const std::string& job, std::uint32_t world) {
    client = std::make_unique<Client>(Client::connect(socket));
    auto items = frozen.Items("frozen");
    for (auto& item : live.Items("live")) items.push_back(item);
    client->register_items(job, rank, world, items);
  }
  void Save(std::uint64_t v) {
    frozen.Fill(1);
    live.Fill(v);
    client->snapshot(v);
  }
  // Restores the newest version, byte-exact; the tier it read.
  std::string Restore(std::uint64_t expect) {
    frozen.Fill(999);
    live.Fill(999);
    RestoreResult got = client->restore();
    INFO("rank " << rank);
    REQUIRE(got.version == expect);
    CHECK(frozen.FirstMismatch(1) == -1);
    CHECK(live.FirstMismatch(expect) == -1);
    return got.tier;
  }
};

// Both ranks on node 0 (kRanksPerNode), replicated to node 1.
struct FineTuneJob {
  std::string name = "delta";
  std::uint32_t world = 2;
  std::vector<std::unique_ptr<FineTuneRank>> ranks;
  void Launch(Cluster& c) {
    ranks.clear();
    for (std::uint32_t r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<FineTuneRank>(r));
      ranks.back()->Connect(c.socket(0), name, world);
    }
  }
  void Save(std::uint64_t v) {
    for (auto& r : ranks) r->Save(v);
    for (auto& r : ranks) r->client->wait_durable(v, Level::kCommitted);
    for (auto& r : ranks) r->client->wait_durable(v, Level::kReplicated);
  }
};

const std::string kFull = "ckptd_replication_transfer_bytes_total{kind=\"full\"}";
const std::string kDelta = "ckptd_replication_transfer_bytes_total{kind=\"delta\"}";
const std::string kSkipped = "ckptd_replication_transfer_bytes_total{kind=\"skipped\"}";
const std::string kReceived = "ckptd_replication_bytes_total{direction=\"received\"}";

}  // namespace

TEST_CASE(
    "a version whose items mostly did not change goes to the peer as a delta, and the lost node restores it "
    "byte-exact from the peer",
    "[replication][delta]") {
  TempDir dir("delta1");
  Cluster c(dir, 2, 1);
  c.StartAll();
  FineTuneJob job;
  job.Launch(c);
  job.Save(1);
  const double full_1 = Metric(c.socket(0), kFull);
  const double received_1 = Metric(c.socket(1), kReceived);
  const double data_bytes = 2.0 * (kFrozenTensors + kLiveTensors) * kDeltaTensorBytes;  // two ranks
  CHECK(full_1 > data_bytes);  // two whole images: data and headers
  CHECK(Metric(c.socket(0), kDelta) == 0);

  for (std::uint64_t v = 2; v <= 4; ++v) job.Save(v);
  const double delta = Metric(c.socket(0), kDelta);
  const double skipped = Metric(c.socket(0), kSkipped);
  const double received = Metric(c.socket(1), kReceived) - received_1;
  // Versions 2-4 went whole to nobody: every byte of theirs was sent in a delta or skipped.
  CHECK(Metric(c.socket(0), kFull) == full_1);
  CHECK(delta + skipped == Approx(3 * full_1));
  CHECK(received == delta);  // the peer received what the deltas sent, nothing else
  const double fraction = delta / (delta + skipped);
  WARN("bytes sent for versions 2-4: " << delta << " of " << delta + skipped << " (" << fraction << ")");
  CHECK(fraction < 0.25);
  CHECK(fraction > 0.05);  // the live tensors did go

  c.Lose(0);
  c.Start(0);  // the replacement node, empty
  job.Launch(c);
  for (auto& r : job.ranks) CHECK(r->Restore(4) == "peer");
  auto fresh = c[0].Status();
  CHECK(fresh.restored_bytes_persistent() == 0);
  CHECK(fresh.restored_bytes_local() == 0);
}

TEST_CASE("with --no-replica-deltas every version goes to the peer whole, and the lost node restores it",
          "[replication][delta]") {
  TempDir dir("delta-off");
  Cluster c(dir, 2, 1);
  c.extra_args = {"--no-replica-deltas"};
  c.StartAll();
  FineTuneJob job;
  job.Launch(c);
  job.Save(1);
  const double full_1 = Metric(c.socket(0), kFull);
  REQUIRE(full_1 > 0);
  for (std::uint64_t v = 2; v <= 3; ++v) job.Save(v);
  // The same items unchanged as in the test above, and still three whole images, no delta.
  CHECK(Metric(c.socket(0), kFull) == 3 * full_1);
  CHECK(Metric(c.socket(0), kDelta) == 0);
  CHECK(Metric(c.socket(0), kSkipped) == 0);
  CHECK_THAT(c[0].Log(), Catch::Contains("replicated version 3 of job delta rank 0 to " + c.addresses[1] +
                                         " whole: "));

  c.Lose(0);
  c.Start(0);
  job.Launch(c);
  for (auto& r : job.ranks) CHECK(r->Restore(3) == "peer");
}

TEST_CASE("a peer that no longer holds the base gets the whole image, and it restores",
          "[replication][delta]") {
  TempDir dir("delta2");
  Cluster c(dir, 2, 1);
  c.StartAll();
  FineTuneJob job;
  job.Launch(c);
  job.Save(1);
  job.Save(2);
  const double full_1 = Metric(c.socket(0), kFull);  // version 1, whole
  const double delta_2 = Metric(c.socket(0), kDelta);
  REQUIRE(delta_2 > 0);  // version 2 went as a delta on 1

  // The peer restarts empty: it holds no version 2 to compose version 3 from.
  c.Lose(1);
  c.Start(1);
  job.Save(3);
  // Refused as a delta (FAILED_PRECONDITION), then sent whole: as many bytes as version 1.
  CHECK(Metric(c.socket(0), kDelta) == delta_2);
  CHECK(Metric(c.socket(0), kFull) == 2 * full_1);
  CHECK(Metric(c.socket(1), "ckptd_replication_events_total{event=\"refused\"}") == 2);
  // And the next version is a delta again, on version 3.
  job.Save(4);
  CHECK(Metric(c.socket(0), kDelta) > delta_2);
  CHECK(Metric(c.socket(0), kFull) == 2 * full_1);
  const std::string log = c[0].Log();
  CHECK_THAT(log, Catch::Contains("refused job delta version 3 rank 0 as a delta on version 2"));
  CHECK_THAT(log, Catch::Contains("replicated version 4 of job delta rank 0 to " + c.addresses[1] +
                                  " as a delta on version 3: "));

  c.Lose(0);
  c.Start(0);
  job.Launch(c);
  for (auto& r : job.ranks) CHECK(r->Restore(4) == "peer");
}

TEST_CASE("a restore that leaves the timeline starts it again with whole images, then deltas on it",
          "[replication][delta]") {
  TempDir dir("delta3");
  Cluster c(dir, 2, 1);
  c.StartAll();
  FineTuneJob job;
  job.Launch(c);
  for (std::uint64_t v = 1; v <= 3; ++v) job.Save(v);
  const double full_1 = Metric(c.socket(0), kFull);
  // Back to version 2 (a new registration; the peer drops version 3), then a new version 3
  // with other contents of the live tensors.
  for (auto& r : job.ranks) {
    r->frozen.Fill(999);
    r->live.Fill(999);
    REQUIRE(r->client->restore(2).version == 2);
    CHECK(r->live.FirstMismatch(2) == -1);
  }
  for (auto& r : job.ranks) {
    r->frozen.Fill(1);
    r->live.Fill(33);
    r->client->snapshot(3);
  }
  for (auto& r : job.ranks) r->client->wait_durable(3, Level::kCommitted);
  for (auto& r : job.ranks) r->client->wait_durable(3, Level::kReplicated);
  // Whole, without a delta tried on the left timeline's version 3.
  CHECK(Metric(c.socket(0), kFull) == 2 * full_1);
  CHECK(Metric(c.socket(1), "ckptd_replication_events_total{event=\"refused\"}") == 0);
  const double delta_3 = Metric(c.socket(0), kDelta);
  job.Save(4);
  CHECK(Metric(c.socket(0), kDelta) > delta_3);
  CHECK(Metric(c.socket(0), kFull) == 2 * full_1);

  c.Lose(0);
  c.Start(0);
  job.Launch(c);
  for (auto& r : job.ranks) CHECK(r->Restore(4) == "peer");
}

TEST_CASE("ReceiveImage composes a delta from its base only when every byte is sent or the same in the base",
          "[replication][delta][wire]") {
  const PeerSecret secret("a shared secret of the test cluster");
  const ShardMeta base_meta{"job-d", 1, 3, 4, "reg-1"};
  const ShardMeta meta{"job-d", 2, 3, 4, "reg-1"};
  const std::vector<std::string> base_items = {Pattern(100'000, 1), Pattern(200'000, 2), Pattern(150'000, 3),
                                               Pattern(50'000, 4)};
  std::vector<std::string> items = base_items;
  items[1] = Pattern(200'000, 9);  // t1 changed; t0, t2, t3 did not
  const std::string base_file = ShardFile(base_meta, base_items);
  const std::string file = ShardFile(meta, items);
  auto base = Image(base_meta, base_file.size(), base_file);
  auto image = Image(meta, file.size(), file);
  const std::uint64_t header_end = HeaderEndOf(file, meta);
  DeltaPlan plan{1, DeltaRanges(header_end, SpansOf(file, meta), SpansOf(base_file, base_meta))};
  REQUIRE(plan.ranges.size() == 2);  // the header, t1
  REQUIRE(plan.bytes() == header_end + 200'000);

  SECTION("a good delta makes the whole image; only the header and t1 travel") {
    std::uint64_t received = 0;
    auto got = Receive(secret, Pieces(secret, image, plan, 1), base, &received);
    REQUIRE(got.ok());
    CHECK(std::string(got.value()->data(), got.value()->file_bytes) == file);
    CHECK(received == plan.bytes());
  }

  SECTION("a whole image is still taken where a base is at hand") {
    std::uint64_t received = 0;
    auto got = Receive(secret, Pieces(secret, image, DeltaPlan{}, 0), base, &received);
    REQUIRE(got.ok());
    CHECK(std::string(got.value()->data(), got.value()->file_bytes) == file);
    CHECK(received == file.size());
  }

  SECTION("no base held: FAILED_PRECONDITION") {
    auto got = Receive(secret, Pieces(secret, image, plan, 1), nullptr, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(got.status().message(), Catch::Contains("delta on version 1"));
  }

  SECTION("a base of another registration: FAILED_PRECONDITION") {
    const ShardMeta other{"job-d", 1, 3, 4, "reg-0"};
    auto got = Receive(secret, Pieces(secret, image, plan, 1),
                       Image(other, base_file.size(), ShardFile(other, base_items)), nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kFailedPrecondition);
  }

  SECTION("an item skipped whose checksum differs from the base's: DATA_LOSS") {
    // The sender skips t1 too, as if the base held it unchanged.
    DeltaPlan forged{1, {{0, header_end}}};
    auto got = Receive(secret, Pieces(secret, image, forged, 1), base, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(got.status().message(), Catch::Contains("item 't1'"));
  }

  SECTION("an item skipped that the base holds at another offset, or under another name: DATA_LOSS") {
    // The same bytes, the items in another order (t2 first), or t0 renamed.
    for (bool renamed : {false, true}) {
      INFO((renamed ? "renamed" : "moved"));
      const std::string moved =
          renamed ? ShardFile(meta, items, {"u0", "t1", "t2", "t3"})
                  : ShardFile(meta, {items[2], items[1], items[0], items[3]}, {"t2", "t1", "t0", "t3"});
      auto moved_image = Image(meta, moved.size(), moved);
      // Everything but the header skipped: the receiver must find every item in the base.
      DeltaPlan forged{1, {{0, HeaderEndOf(moved, meta)}}};
      auto got = Receive(secret, Pieces(secret, moved_image, forged, 1), base, nullptr);
      REQUIRE_FALSE(got.ok());
      CHECK(got.status().code() == StatusCode::kDataLoss);
      CHECK_THAT(got.status().message(), Catch::Contains("did not send all of item"));
    }
  }

  SECTION("a MAC bound to another base, or to a whole image: PERMISSION_DENIED") {
    for (std::uint64_t mac_base : {std::uint64_t{0}, std::uint64_t{7}}) {
      INFO("MAC bound to base " << mac_base);
      auto got = Receive(secret, Pieces(secret, image, plan, mac_base), base, nullptr);
      REQUIRE_FALSE(got.ok());
      CHECK(got.status().code() == StatusCode::kPermissionDenied);
    }
  }

  SECTION("a delta's piece moved to another offset: refused, nothing kept") {
    // t1's bytes, unchanged (its piece checksum still right), 8 bytes further on: t1 is then
    // neither sent whole nor the same in the base (DATA_LOSS); a move that the coverage
    // check let through would change the image composed, which the MAC covers whole.
    auto pieces = Pieces(secret, image, plan, 1, 1 << 20);
    REQUIRE(pieces.size() == 2);
    auto p = WirePiece::Parse(pieces[1]);
    REQUIRE(p.ok());
    v1::ShardPiece fields = p->fields();
    fields.set_offset(fields.offset() + 8);
    auto data = std::make_shared<std::string>(p->data_bytes(), '\0');
    p->CopyData(data->data(), nullptr);
    pieces[1] = EncodePiece(fields, data, data->data(), data->size());
    auto got = Receive(secret, pieces, base, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kDataLoss);
  }

  SECTION("no room beside the base: FAILED_PRECONDITION (the whole image may fit), a whole image RESOURCE_EXHAUSTED") {
    auto delta = Receive(secret, Pieces(secret, image, plan, 1), base, nullptr, /*room=*/false);
    REQUIRE_FALSE(delta.ok());
    CHECK(delta.status().code() == StatusCode::kFailedPrecondition);
    auto whole = Receive(secret, Pieces(secret, image, DeltaPlan{}, 0), base, nullptr, /*room=*/false);
    REQUIRE_FALSE(whole.ok());
    CHECK(whole.status().code() == StatusCode::kResourceExhausted);
  }

  SECTION("bytes the delta skips are covered by the MAC: a sender whose skipped item differs is refused") {
    // The sender's t3 holds other bytes than the base's while its header claims the base's
    // checksum (what an xxh3 collision would look like from the receiver): the item is
    // skipped, the composed t3 passes its checksum, and only the MAC over the whole image
    // composed tells it from the sender's.
    std::string odd = file;
    odd[odd.size() - 1] ^= 0x5a;  // in t3; the header is unchanged
    auto odd_image = Image(meta, odd.size(), odd);
    auto got = Receive(secret, Pieces(secret, odd_image, plan, 1), base, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kPermissionDenied);
  }

  SECTION("a base whose bytes no longer match its header: FAILED_PRECONDITION (the whole image is needed)") {
    auto damaged = Image(base_meta, base_file.size(), base_file);
    damaged->data()[damaged->file_bytes - 1] ^= 0x5a;  // in t3, which the delta takes from the base
    auto got = Receive(secret, Pieces(secret, image, plan, 1), damaged, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(got.status().message(), Catch::Contains("item 't3'"));
  }

  SECTION("a base as new as the version: DATA_LOSS") {
    DeltaPlan same{2, plan.ranges};
    auto got = Receive(secret, Pieces(secret, image, same, 2), base, nullptr);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("DeltaRanges: the header and the changed items, nothing when no item is the same",
          "[replication][delta]") {
  const std::vector<ItemSpan> base = {
      {"a", 100, 10, 1}, {"b", 110, 20, 2}, {"c", 130, 30, 3}, {"d", 160, 5, 4}};
  SECTION("b changed") {
    auto now = base;
    now[1].checksum = 9;
    auto r = DeltaRanges(100, now, base);
    REQUIRE(r.size() == 2);
    CHECK(r[0].offset == 0);
    CHECK(r[0].bytes == 100);
    CHECK(r[1].offset == 110);
    CHECK(r[1].bytes == 20);
  }
  SECTION("a and b changed: one range with the header") {
    auto now = base;
    now[0].checksum = 8;
    now[1].checksum = 9;
    auto r = DeltaRanges(100, now, base);
    REQUIRE(r.size() == 1);
    CHECK(r[0].bytes == 130);
  }
  SECTION("every item changed, or moved: no delta") {
    auto now = base;
    for (auto& i : now) i.checksum += 100;
    CHECK(DeltaRanges(100, now, base).empty());
    now = base;
    for (auto& i : now) i.offset += 8;
    CHECK(DeltaRanges(108, now, base).empty());
  }
}
