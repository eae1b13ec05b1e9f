#include "format/markers.h"

#include <limits>
#include <nlohmann/json.hpp>

#include "common/decimal.h"
#include "format/limits.h"

namespace ckpt {

std::string RenderLatest(std::uint64_t version) { return std::to_string(version) + "\n"; }

std::optional<std::uint64_t> ParseLatest(std::string_view text) {
  if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  if (text.empty() || text.size() > 20 || (text.size() > 1 && text[0] == '0')) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    std::uint64_t d = static_cast<std::uint64_t>(c - '0');
    if (v > (std::numeric_limits<std::uint64_t>::max() - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

std::string RenderCommitted(const CommittedMarker& marker) {
  return "{\"job\":" + nlohmann::json(marker.job).dump() + ",\"version\":" + std::to_string(marker.version) +
         ",\"world_size\":" + std::to_string(marker.world_size) +
         ",\"committed_at\":" + std::to_string(marker.committed_at) + "}\n";
}

Result<CommittedMarker> ParseCommitted(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return DataLoss("COMMITTED is not a JSON object");
  CommittedMarker m;
  auto job = j.find("job");
  if (job == j.end() || !job->is_string()) return DataLoss("COMMITTED names no job");
  m.job = job->get<std::string>();
  auto version = j.find("version");
  if (version == j.end() || !version->is_number_unsigned()) return DataLoss("COMMITTED names no version");
  m.version = version->get<std::uint64_t>();
  auto world = j.find("world_size");
  if (world == j.end() || !world->is_number_unsigned() || world->get<std::uint64_t>() == 0) {
    return DataLoss("COMMITTED names no world size");
  }
  if (world->get<std::uint64_t>() > kMaxWorldSize) {
    return DataLoss("COMMITTED names world size " + std::to_string(world->get<std::uint64_t>()) +
                    ", over the largest a reader takes (" + std::to_string(kMaxWorldSize) + ")");
  }
  m.world_size = static_cast<std::uint32_t>(world->get<std::uint64_t>());
  auto at = j.find("committed_at");
  if (at == j.end() || !at->is_number_integer() ||
      (at->is_number_unsigned() &&
       at->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))) {
    return DataLoss("COMMITTED has no commit time");
  }
  m.committed_at = at->get<std::int64_t>();
  return m;
}

std::optional<std::string> ParseRegistration(std::string_view text) {
  if (text.empty() || text.size() > kMaxRegistrationBytes) return std::nullopt;
  for (char c : text) {
    bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) return std::nullopt;
  }
  return std::string(text);
}

std::string RenderNodeMarker(const NodeClaims& claims) {
  std::string out;
  for (const auto& [rank, registration] : claims) {
    out += std::to_string(rank) + " " + registration + "\n";
  }
  return out;
}

std::optional<NodeClaims> ParseNodeMarker(std::string_view text) {
  NodeClaims claims;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    if (nl == std::string_view::npos || claims.size() == kMaxNodeMarkerRanks) return std::nullopt;
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    const auto space = line.find(' ');
    if (space == std::string_view::npos) return std::nullopt;
    auto rank = ParseDecimal(line.substr(0, space));
    auto registration = ParseRegistration(line.substr(space + 1));
    if (!rank || *rank > std::numeric_limits<std::uint32_t>::max() || !registration) return std::nullopt;
    const auto r = static_cast<std::uint32_t>(*rank);
    if (!claims.empty() && claims.rbegin()->first >= r) return std::nullopt;  // increasing, once each
    claims.emplace_hint(claims.end(), r, std::move(*registration));
  }
  if (claims.empty()) return std::nullopt;
  return claims;
}

std::string RenderRestorable(const RestorableMarker& marker) {
  return "world_size " + std::to_string(marker.world_size) + "\n" + RenderNodeMarker(marker.registrations);
}

std::optional<RestorableMarker> ParseRestorable(std::string_view text) {
  constexpr std::string_view kPrefix = "world_size ";
  if (!text.starts_with(kPrefix)) return std::nullopt;
  text.remove_prefix(kPrefix.size());
  const auto nl = text.find('\n');
  if (nl == std::string_view::npos) return std::nullopt;
  auto world = ParseDecimal(text.substr(0, nl));
  if (!world || *world == 0 || *world > kMaxNodeMarkerRanks) return std::nullopt;
  auto claims = ParseNodeMarker(text.substr(nl + 1));
  // Every rank once, in order (ParseNodeMarker holds them increasing): 0..W-1 exactly.
  if (!claims || claims->size() != *world || claims->rbegin()->first != *world - 1) return std::nullopt;
  return RestorableMarker{static_cast<std::uint32_t>(*world), std::move(*claims)};
}

std::string RenderRankRecord(const RankRecord& record) {
  return std::to_string(record.generation) + " " + record.registration;
}

std::optional<RankRecord> ParseRankRecord(std::string_view text) {
  const auto space = text.find(' ');
  if (space == std::string_view::npos) {
    auto old = ParseRegistration(text);
    if (!old) return std::nullopt;
    return RankRecord{0, std::move(*old)};
  }
  auto generation = ParseDecimal(text.substr(0, space));
  auto registration = ParseRegistration(text.substr(space + 1));
  if (!generation || *generation == 0 || !registration) return std::nullopt;
  return RankRecord{*generation, std::move(*registration)};
}

}  // namespace ckpt
