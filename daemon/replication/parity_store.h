// ParityStore: the parity a daemon holds for its erasure-coding group (ckptd --erasure K+M;
// the scheme is in erasure_group.h), and the names both ends bind their MACs to.
//
// A stripe is (job, version, slot, stripe number s). Daemon h of the group (its position in
// the group, 0..K+M-1) holds parity row j of stripe s when (h - s) mod (K+M) = j < M; the
// data positions 0..K-1 of stripe s are the daemons (s + M + c) mod (K+M). Fold checks that
// a chunk comes to the daemon that holds its stripe's row, from the daemon at its position,
// and folds it into the parity (ErasureCode::Accumulate): parity = the sum of each member's
// chunk times its coefficient, so the parity never holds a member's bytes, and a member
// whose chunk never came counts as zeros. A chunk longer than the parity so far extends it
// with zeros (members' shards differ in size). The parity's xxh3-64 is computed after each
// fold; GetParity serves it with the parity, and the rebuilder checks it, so that parity
// corrupted in memory is found, treated as missing, and never decoded into a shard.
//
// A member already folded in that comes again with the same chunk (a retried send) is a
// no-op; one that comes with another chunk (the version was written again, on a new
// timeline) empties the stripe first: the sum cannot take a member out. The stripe then
// holds only what came since, and a rebuild that needs an older member fails its checksum
// and falls back to the next source.
//
// Retention follows the members' memory tiers, which keep a job's newest `versions_kept`
// committed versions and every newer one: once this daemon has seen that many commits of the
// job (OnCommitted), the stripes of versions below the oldest of them are dropped, and a
// chunk of such a version is refused (FailedPrecondition: late). Of the versions above the
// newest committed one, the newest kUncommittedKept are kept. The store holds at most
// `max_bytes` of parity: when a fold would pass it, the parity of the other jobs, those
// folded into least recently first, is dropped whole (a job killed without finishing leaves
// its parity until then), unless dropping them all would not make room: then the chunk is
// refused (ResourceExhausted) and nothing is dropped.
//
// Thread-safety: every method may run concurrently. A parity handed out by Find is a
// snapshot: a later fold writes a copy.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ckpt/v1/peer.pb.h"
#include "common/mutex.h"
#include "common/status.h"
#include "daemon/replication/erasure_code.h"

namespace ckpt {

// The largest chunk a holder takes (PutChunk holds one whole until its MAC is checked), so
// the largest parity row: shards up to K x this are protected.
inline constexpr std::uint64_t kMaxErasureChunkBytes = std::uint64_t{16} << 30;

// The group geometry: K data and M parity positions, the daemons at them (--peers entries).
struct ErasureGeometry {
  unsigned k = 0;
  unsigned m = 0;
  std::vector<std::string> members;  // K + M addresses, by position
  unsigned self = 0;                 // this daemon's position
  unsigned n() const { return k + m; }
  // The position of `address` in the group, or -1.
  int PositionOf(const std::string& address) const;
  // Stripe s's data position c: the daemon's position.
  unsigned DataAt(unsigned s, unsigned c) const { return (s + m + c) % n(); }
  // The stripe in which position p holds its data chunk c.
  unsigned StripeOf(unsigned p, unsigned c) const { return (p + 2 * n() - m - c) % n(); }
  // The daemon holding parity row j of stripe s.
  unsigned HolderOf(unsigned s, unsigned j) const { return (s + j) % n(); }
};

// What each MAC of the erasure calls covers after its bytes: the call, its nonce, and every
// field that says what the bytes are.
std::string ChunkBinding(const std::string& call, const std::string& nonce, const v1::StripeMember& member);
std::string ParityBinding(const std::string& nonce, const v1::ParityPiece& first);
std::string RangeBinding(const std::string& nonce, const std::string& job, std::uint64_t version, std::uint32_t rank,
                         std::uint64_t offset, std::uint64_t length);

class ParityStore {
 public:
  static constexpr std::uint32_t kUncommittedKept = 16;
  ParityStore(ErasureCode code, ErasureGeometry geometry, std::uint32_t versions_kept, std::uint64_t max_bytes,
              bool corrupt_for_tests);

  const ErasureGeometry& geometry() const { return geometry_; }
  const ErasureCode& code() const { return code_; }

  // Folds `chunk` (member.chunk_bytes bytes, already checked against member.chunk_xxh3)
  // into the stripe's parity. InvalidArgument when the member does not belong here (a
  // stripe this daemon holds no row of, a position that is not the origin's, sizes that do
  // not fit).
  Status Fold(const v1::StripeMember& member, const std::uint8_t* chunk) EXCLUDES(mu_);

  struct Held {
    std::vector<v1::StripeMember> members;  // by position; absent ones have an empty origin
    unsigned row = 0;
    std::uint64_t parity_xxh3 = 0;
    std::shared_ptr<const std::vector<std::uint8_t>> parity;
  };
  // The stripe s of (job, version) whose member `origin`'s rank `rank` is in it.
  std::optional<Held> Find(const std::string& job, std::uint64_t version, unsigned stripe,
                           const std::string& origin, std::uint32_t rank) EXCLUDES(mu_);
  // Drops the job's stripes above `version` (every one with `all`); how many.
  std::uint32_t Drop(const std::string& job, std::uint64_t version, bool all) EXCLUDES(mu_);
  // `version` of `job` committed (retention, above).
  void OnCommitted(const std::string& job, std::uint64_t version) EXCLUDES(mu_);

  std::uint64_t parity_bytes() const EXCLUDES(mu_);
  std::uint64_t stripes() const EXCLUDES(mu_);
  // The test seam CKPTD_TEST_CORRUPT_PARITY=1: GetParity serves the parity with a byte
  // flipped, as memory corruption would leave it.
  bool corrupt_for_tests() const { return corrupt_for_tests_; }

 private:
  using Key = std::tuple<std::string, std::uint64_t, std::uint32_t, std::uint32_t>;  // job, version, slot, stripe
  struct Stripe {
    std::vector<v1::StripeMember> members;  // K, by position
    std::shared_ptr<std::vector<std::uint8_t>> parity = std::make_shared<std::vector<std::uint8_t>>();
    std::uint64_t parity_xxh3 = 0;
  };
  void Retain(const std::string& job) REQUIRES(mu_);
  // The oldest version of `job` kept (0: no bound yet).
  std::uint64_t OldestKeptLocked(const std::string& job) const REQUIRES(mu_);
  // Drops every stripe of `job`.
  void DropJobLocked(const std::string& job) REQUIRES(mu_);

  const ErasureCode code_;
  const ErasureGeometry geometry_;
  const std::uint32_t versions_kept_;
  const std::uint64_t max_bytes_;
  const bool corrupt_for_tests_;
  mutable Mutex mu_;
  std::map<Key, Stripe> stripes_ GUARDED_BY(mu_);
  std::uint64_t bytes_ GUARDED_BY(mu_) = 0;
  // Per job, the newest versions_kept versions seen to commit.
  std::map<std::string, std::set<std::uint64_t>> committed_ GUARDED_BY(mu_);
  // Per job, when a chunk was last folded into it (a counter): the eviction order.
  std::map<std::string, std::uint64_t> last_fold_ GUARDED_BY(mu_);
  std::uint64_t folds_ GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt
