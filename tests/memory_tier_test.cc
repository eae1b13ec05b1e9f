// MemoryTier's rules for replicas, on the class itself: a replica never takes the
// place of this daemon's own shard, complete or still being captured, and a replica short of
// room drops older replicas only, never a newer one of its own rank.
#include <catch2/catch.hpp>
#include <string>

#include "daemon/tiers/memory_tier.h"

using namespace ckpt;

namespace {

constexpr std::uint64_t kMiB = 1 << 20;

ShardMeta Meta(const std::string& job, std::uint64_t version, std::uint32_t rank) {
  ShardMeta m;
  m.job = job;
  m.version = version;
  m.rank = rank;
  m.world_size = 8;
  return m;
}

}  // namespace

TEST_CASE("a replica does not replace this daemon's own shard of the same version", "[memory_tier]") {
  MemoryTier tier(16 * kMiB, 2);
  auto own = tier.Reserve(Meta("j", 3, 1), kMiB);
  REQUIRE(own);
  SECTION("while it is being captured") {
    CHECK_FALSE(tier.ReserveReplica(Meta("j", 3, 1), kMiB, "10.0.0.2:7000"));
    tier.Complete(own);
    CHECK(tier.Find("j", 3, 1) == own);
  }
  SECTION("once it is complete") {
    tier.Complete(own);
    bool own_shard = false;
    CHECK_FALSE(tier.ReserveReplica(Meta("j", 3, 1), kMiB, "10.0.0.2:7000", &own_shard));
    CHECK(own_shard);  // the reason is told apart from a lack of room
    CHECK(tier.Find("j", 3, 1) == own);
  }
  CHECK(tier.ReplicaBytes().empty());
}

TEST_CASE("a replica refused for lack of room is told apart from one refused for an own shard", "[memory_tier]") {
  MemoryTier tier(4 * kMiB, 2);
  auto own = tier.Reserve(Meta("j", 1, 0), 3 * kMiB);
  REQUIRE(own);
  tier.Complete(own);
  bool own_shard = true;
  CHECK_FALSE(tier.ReserveReplica(Meta("j", 1, 1), 3 * kMiB, "a", &own_shard));
  CHECK_FALSE(own_shard);
}

TEST_CASE("a replica short of room drops older replicas, never a newer one of its rank", "[memory_tier]") {
  // Room for two 4 MiB images.
  MemoryTier tier(8 * kMiB, 4);
  auto r5 = tier.ReserveReplica(Meta("j", 5, 2), 4 * kMiB, "a");
  REQUIRE(r5);
  tier.Complete(r5);
  auto other = tier.ReserveReplica(Meta("k", 1, 0), 4 * kMiB, "a");
  REQUIRE(other);
  tier.Complete(other);
  r5.reset();
  other.reset();
  SECTION("an older version of the same rank is refused rather than dropping version 5") {
    // Rank 2's only replica is newer: the other job's replica gives way.
    auto r4 = tier.ReserveReplica(Meta("j", 4, 2), 4 * kMiB, "a");
    REQUIRE(r4);
    CHECK(tier.Find("j", 5, 2) != nullptr);
    CHECK(tier.Find("k", 1, 0) == nullptr);
  }
  SECTION("a newer version of the same rank drops the older one first") {
    auto r6 = tier.ReserveReplica(Meta("j", 6, 2), 4 * kMiB, "a");
    REQUIRE(r6);
    tier.Complete(r6);
    CHECK(tier.Find("j", 5, 2) == nullptr);
    CHECK(tier.Find("k", 1, 0) != nullptr);
  }
}

// A delta's reservation, made while the transfer holds its base: the rank's older replicas
// other than the base give way (the version the base replaced), other ranks' never.
TEST_CASE("a delta's replica drops the rank's older replicas but its base, and no other rank's", "[memory_tier]") {
  MemoryTier tier(12 * kMiB, 4);
  auto older = tier.ReserveReplica(Meta("j", 4, 2), 4 * kMiB, "a");
  REQUIRE(older);
  tier.Complete(older);
  older.reset();
  auto base = tier.ReserveReplica(Meta("j", 5, 2), 4 * kMiB, "a");
  REQUIRE(base);
  tier.Complete(base);  // held, as a delta's transfer holds its base
  auto other = tier.ReserveReplica(Meta("k", 1, 0), 4 * kMiB, "a");
  REQUIRE(other);
  tier.Complete(other);
  other.reset();
  // Full: version 6 as a delta on 5 takes the room of version 4.
  auto v6 = tier.ReserveReplica(Meta("j", 6, 2), 4 * kMiB, "a", nullptr, /*delta_base=*/5);
  REQUIRE(v6);
  CHECK(tier.Find("j", 4, 2) == nullptr);
  CHECK(tier.Find("j", 5, 2) != nullptr);
  CHECK(tier.Find("k", 1, 0) != nullptr);
  tier.Complete(v6);
  v6.reset();
  base.reset();  // version 6's transfer is over
  // Version 7 as a delta on 6: 5 goes (older, not its base), and it fits.
  auto v7 = tier.ReserveReplica(Meta("j", 7, 2), 4 * kMiB, "a", nullptr, /*delta_base=*/6);
  REQUIRE(v7);
  CHECK(tier.Find("j", 5, 2) == nullptr);
  CHECK(tier.Find("j", 6, 2) != nullptr);
  CHECK(tier.Find("k", 1, 0) != nullptr);
  tier.Complete(v7);
  v7.reset();

  SECTION("too little to drop beside its base: refused, and nothing dropped") {
    // Version 6 (4 MiB) is all that may give way, and version 8 needs 8 MiB.
    auto v8 = tier.ReserveReplica(Meta("j", 8, 2), 8 * kMiB, "a", nullptr, /*delta_base=*/7);
    CHECK_FALSE(v8);
    CHECK(tier.Find("j", 6, 2) != nullptr);
    CHECK(tier.Find("j", 7, 2) != nullptr);
    CHECK(tier.Find("k", 1, 0) != nullptr);
  }
  SECTION("an older replica still read frees nothing, so it is not dropped") {
    auto reading = tier.Find("j", 6, 2);  // a restore reads it
    REQUIRE(reading);
    CHECK_FALSE(tier.ReserveReplica(Meta("j", 8, 2), 4 * kMiB, "a", nullptr, /*delta_base=*/7));
    reading.reset();
    CHECK(tier.Find("j", 6, 2) != nullptr);
  }
  SECTION("the whole image that follows may drop the base and other ranks' replicas") {
    CHECK(tier.ReserveReplica(Meta("j", 8, 2), 8 * kMiB, "a"));
    CHECK(tier.Find("j", 7, 2) == nullptr);
  }
}

TEST_CASE("with nothing older to drop, a replica is refused and the newer ones stay", "[memory_tier]") {
  MemoryTier tier(4 * kMiB, 4);
  auto r5 = tier.ReserveReplica(Meta("j", 5, 2), 4 * kMiB, "a");
  REQUIRE(r5);
  tier.Complete(r5);
  r5.reset();
  CHECK_FALSE(tier.ReserveReplica(Meta("j", 4, 2), 4 * kMiB, "a"));
  CHECK(tier.Find("j", 5, 2) != nullptr);
}
