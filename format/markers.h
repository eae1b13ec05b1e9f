// The small files of the commit protocol (format/paths.h draws where they live):
//
//   ROOT/JOB/latest                        "42\n": the newest committed version
//   ROOT/JOB/vNNNNNNNNNN/COMMITTED         {"job":"J","version":42,"world_size":8,"committed_at":T}\n
//   ROOT/JOB/vNNNNNNNNNN/node-OWNER.K.done one line "RANK REGISTRATION" for each of the K ranks
//                                          whose shard a daemon made durable
//   ROOT/JOB/vNNNNNNNNNN/node-OWNER.K.repl the same lines, for the ranks whose shards peers hold
//   ROOT/JOB/vNNNNNNNNNN/RESTORABLE        "world_size W" and a line per rank
//   ROOT/JOB/ranks/rank-NNNNN              "GENERATION REGISTRATION": the rank's newest
//   ROOT/JOB/ranks/rank-NNNNN.G.REG        the registration REG (generation G), its id again
//
// Each is rendered and parsed here only, so the daemon, the tools and the fuzzers
// (tests/fuzz/) agree on one spelling. The files lie on a shared file system that anyone with
// write access may have edited, so the parsers accept exactly what the renderers write (a
// trailing newline aside, for `latest`) and reject everything else without guessing.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ckpt {

// The longest registration id a done marker or rank file may hold.
inline constexpr std::size_t kMaxRegistrationBytes = 128;

// `latest`: the version in decimal and a newline.
std::string RenderLatest(std::uint64_t version);
// Decimal digits without sign, blanks or leading zeros (a lone "0" aside), optionally
// followed by one newline, that fit 64 bits; nullopt for anything else.
std::optional<std::uint64_t> ParseLatest(std::string_view text);

// COMMITTED: written last, once every rank of the version is durable.
struct CommittedMarker {
  std::string job;
  std::uint64_t version = 0;
  std::uint32_t world_size = 0;
  std::int64_t committed_at = 0;  // seconds since the epoch
};
std::string RenderCommitted(const CommittedMarker& marker);
// A JSON object with at least these four keys of these types (job: a string; version and
// world_size: non-negative integers, world_size 1..kMaxWorldSize (format/limits.h);
// committed_at: an integer); other keys are ignored. DataLoss saying what is wrong otherwise.
Result<CommittedMarker> ParseCommitted(std::string_view text);

// Done markers and rank files hold a registration id as it is, without a newline: 1 to
// kMaxRegistrationBytes bytes of [A-Za-z0-9._-]. nullopt for anything else (an empty or torn
// file, stray bytes), which never matches a registration.
std::optional<std::string> ParseRegistration(std::string_view text);

// A node marker: rank -> the registration that wrote its shard. Lines "RANK REGISTRATION\n"
// in increasing rank order, RANK in canonical decimal, 1 to kMaxNodeMarkerRanks of them.
using NodeClaims = std::map<std::uint32_t, std::string>;
inline constexpr std::size_t kMaxNodeMarkerRanks = 1 << 16;
std::string RenderNodeMarker(const NodeClaims& claims);
std::optional<NodeClaims> ParseNodeMarker(std::string_view text);

// VERSION/RESTORABLE, written once the `.repl` markers of a version not committed
// yet claim every rank 0..world_size-1 with its current registration: "world_size W\n", then
// the node marker lines of every rank (each rank, in order, with the registration whose shard
// peers hold). A restore takes it only with shards of exactly these registrations.
struct RestorableMarker {
  std::uint32_t world_size = 0;
  NodeClaims registrations;  // every rank 0..world_size-1
};
std::string RenderRestorable(const RestorableMarker& marker);
// Exactly what RenderRestorable writes, with W >= 1 and the ranks 0..W-1 each once; nullopt
// for anything else.
std::optional<RestorableMarker> ParseRestorable(std::string_view text);

// ranks/rank-R: the rank's newest registration and its generation, "GENERATION REGISTRATION"
// (generation in canonical decimal, >= 1). A file of an older tree holds a registration id
// alone: it parses as generation 0.
struct RankRecord {
  std::uint64_t generation = 0;
  std::string registration;
};
std::string RenderRankRecord(const RankRecord& record);
std::optional<RankRecord> ParseRankRecord(std::string_view text);

}  // namespace ckpt
