#include "daemon/replication/parity_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>

#include "format/checksum.h"

namespace ckpt {
namespace {

// Each field with its length before it: no two different field lists give the same text.
void Put(std::string* out, const std::string& field) {
  *out += std::to_string(field.size());
  *out += ':';
  *out += field;
}
void Put(std::string* out, std::uint64_t n) { Put(out, std::to_string(n)); }

void PutMember(std::string* out, const v1::StripeMember& m) {
  Put(out, m.job());
  Put(out, m.version());
  Put(out, m.slot());
  Put(out, m.stripe());
  Put(out, m.position());
  Put(out, m.rank());
  Put(out, m.world_size());
  Put(out, m.registration());
  Put(out, m.origin());
  Put(out, m.file_bytes());
  Put(out, m.chunk_bytes());
  Put(out, m.chunk_xxh3());
}

bool SameChunk(const v1::StripeMember& a, const v1::StripeMember& b) {
  return a.origin() == b.origin() && a.rank() == b.rank() && a.registration() == b.registration() &&
         a.file_bytes() == b.file_bytes() && a.chunk_bytes() == b.chunk_bytes() && a.chunk_xxh3() == b.chunk_xxh3();
}

}  // namespace

int ErasureGeometry::PositionOf(const std::string& address) const {
  auto it = std::find(members.begin(), members.end(), address);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string ChunkBinding(const std::string& call, const std::string& nonce, const v1::StripeMember& member) {
  std::string out = "ckpt-erasure-chunk\n";
  Put(&out, call);
  Put(&out, nonce);
  PutMember(&out, member);
  return out;
}

std::string ParityBinding(const std::string& nonce, const v1::ParityPiece& first) {
  std::string out = "ckpt-erasure-parity\n";
  Put(&out, nonce);
  Put(&out, first.row());
  Put(&out, first.parity_bytes());
  Put(&out, first.parity_xxh3());
  Put(&out, static_cast<std::uint64_t>(first.members_size()));
  for (const auto& m : first.members()) PutMember(&out, m);
  return out;
}

std::string RangeBinding(const std::string& nonce, const std::string& job, std::uint64_t version, std::uint32_t rank,
                         std::uint64_t offset, std::uint64_t length) {
  std::string out = "ckpt-erasure-range\n";
  Put(&out, nonce);
  Put(&out, job);
  Put(&out, version);
  Put(&out, rank);
  Put(&out, offset);
  Put(&out, length);
  return out;
}

ParityStore::ParityStore(ErasureCode code, ErasureGeometry geometry, std::uint32_t versions_kept,
                         std::uint64_t max_bytes, bool corrupt_for_tests)
    : code_(std::move(code)),
      geometry_(std::move(geometry)),
      versions_kept_(std::max<std::uint32_t>(versions_kept, 1)),
      max_bytes_(max_bytes),
      corrupt_for_tests_(corrupt_for_tests) {}

Status ParityStore::Fold(const v1::StripeMember& member, const std::uint8_t* chunk) {
  const ErasureGeometry& g = geometry_;
  const std::string what = "chunk " + std::to_string(member.position()) + " of stripe " +
                           std::to_string(member.stripe()) + " of job " + member.job() + " version " +
                           std::to_string(member.version());
  if (member.stripe() >= g.n() || member.position() >= g.k) return InvalidArgument(what + ": no such stripe or position");
  const unsigned row = (g.self + g.n() - member.stripe()) % g.n();
  if (row >= g.m) return InvalidArgument(what + ": this daemon holds no parity of that stripe");
  const int from = g.PositionOf(member.origin());
  if (from < 0 || static_cast<unsigned>(from) != g.DataAt(member.stripe(), member.position())) {
    return InvalidArgument(what + " from " + member.origin() + ": that position is another daemon's");
  }
  if (member.chunk_bytes() % kFragmentAlignment != 0 ||
      member.chunk_bytes() != StripeFragmentBytes(member.file_bytes(), g.k)) {
    return InvalidArgument(what + ": its chunk size does not fit its image's size");
  }
  MutexLock lock(mu_);
  if (member.version() < OldestKeptLocked(member.job())) {
    // Late: the members' memory tiers no longer hold that version.
    return FailedPrecondition(what + ": older than the versions the group keeps");
  }
  const Key key{member.job(), member.version(), member.slot(), member.stripe()};
  auto held = stripes_.find(key);
  const std::uint64_t current = held == stripes_.end() ? 0 : held->second.parity->size();
  const std::uint64_t grow = member.chunk_bytes() > current ? member.chunk_bytes() - current : 0;
  if (bytes_ + grow > max_bytes_) {
    // Room from the other jobs, those folded into least recently first; nothing is dropped
    // unless dropping them all would make room.
    std::map<std::string, std::uint64_t> job_bytes;
    for (const auto& [k, st] : stripes_) {
      if (std::get<0>(k) != member.job()) job_bytes[std::get<0>(k)] += st.parity->size();
    }
    std::uint64_t others = 0;
    for (const auto& [job, b] : job_bytes) others += b;
    if (bytes_ - others + grow > max_bytes_) {
      return ResourceExhausted(what + ": no room for its parity (" + std::to_string(bytes_) + " of at most " +
                               std::to_string(max_bytes_) + " bytes held)");
    }
    std::vector<std::pair<std::uint64_t, std::string>> order;
    for (const auto& [job, b] : job_bytes) order.emplace_back(last_fold_.count(job) ? last_fold_[job] : 0, job);
    std::sort(order.begin(), order.end());
    for (const auto& [at, job] : order) {
      if (bytes_ + grow <= max_bytes_) break;
      spdlog::warn("erasure: dropped the parity of job {} for room (at most {} bytes of parity)", job, max_bytes_);
      DropJobLocked(job);
    }
  }
  last_fold_[member.job()] = ++folds_;
  Stripe& s = stripes_[key];
  if (s.members.empty()) s.members.resize(g.k);
  v1::StripeMember& at = s.members[member.position()];
  if (!at.origin().empty()) {
    if (SameChunk(at, member)) return Status::Ok();  // a retried send
    spdlog::warn("erasure: {} came again with other bytes (the version was written again): the stripe starts over",
                 what);
    bytes_ -= s.parity->size();
    s = Stripe{};
    s.members.resize(g.k);
  }
  // A parity a reader holds is not written: the fold goes to a copy.
  if (s.parity.use_count() > 1) s.parity = std::make_shared<std::vector<std::uint8_t>>(*s.parity);
  std::vector<std::uint8_t>& parity = *s.parity;
  if (parity.size() < member.chunk_bytes()) {
    bytes_ += member.chunk_bytes() - parity.size();
    parity.resize(member.chunk_bytes(), 0);
  }
  if (Status st = code_.Accumulate(member.position(), row, chunk, parity.data(), member.chunk_bytes()); !st.ok()) {
    return st;
  }
  s.parity_xxh3 = Checksum::Of(parity.data(), parity.size());
  s.members[member.position()] = member;
  Retain(member.job());
  return Status::Ok();
}

std::uint64_t ParityStore::OldestKeptLocked(const std::string& job) const {
  auto c = committed_.find(job);
  // The oldest of the newest versions_kept commits, once that many were seen.
  return c != committed_.end() && c->second.size() >= versions_kept_ ? *c->second.begin() : 0;
}

void ParityStore::Retain(const std::string& job) {
  std::set<std::uint64_t> versions;
  for (auto it = stripes_.lower_bound(Key{job, 0, 0, 0}); it != stripes_.end() && std::get<0>(it->first) == job; ++it) {
    versions.insert(std::get<1>(it->first));
  }
  std::set<std::uint64_t> drop;
  const std::uint64_t oldest_kept = OldestKeptLocked(job);
  for (std::uint64_t v : versions) {
    if (v < oldest_kept) drop.insert(v);
  }
  // Of the versions above the newest committed one, the newest kUncommittedKept.
  auto c = committed_.find(job);
  const std::uint64_t newest_committed = c == committed_.end() || c->second.empty() ? 0 : *c->second.rbegin();
  std::vector<std::uint64_t> above(versions.upper_bound(newest_committed), versions.end());
  if (above.size() > kUncommittedKept) drop.insert(above.begin(), above.end() - kUncommittedKept);
  if (drop.empty()) return;
  for (auto it = stripes_.lower_bound(Key{job, 0, 0, 0}); it != stripes_.end() && std::get<0>(it->first) == job;) {
    if (drop.count(std::get<1>(it->first)) != 0) {
      bytes_ -= it->second.parity->size();
      it = stripes_.erase(it);
    } else {
      ++it;
    }
  }
}

std::optional<ParityStore::Held> ParityStore::Find(const std::string& job, std::uint64_t version, unsigned stripe,
                                                   const std::string& origin, std::uint32_t rank) {
  MutexLock lock(mu_);
  for (auto it = stripes_.lower_bound(Key{job, version, 0, 0});
       it != stripes_.end() && std::get<0>(it->first) == job && std::get<1>(it->first) == version; ++it) {
    if (std::get<3>(it->first) != stripe) continue;
    const Stripe& s = it->second;
    const bool has = std::any_of(s.members.begin(), s.members.end(), [&](const v1::StripeMember& m) {
      return m.origin() == origin && m.rank() == rank;
    });
    // The member asked for may be the one lost: its entry is what the rebuild needs. A
    // stripe holds it if any of its members came from that origin with that rank.
    if (!has) continue;
    Held h;
    h.members = s.members;
    h.row = (geometry_.self + geometry_.n() - stripe) % geometry_.n();
    h.parity_xxh3 = s.parity_xxh3;
    h.parity = s.parity;
    return h;
  }
  return std::nullopt;
}

std::uint32_t ParityStore::Drop(const std::string& job, std::uint64_t version, bool all) {
  MutexLock lock(mu_);
  std::uint32_t n = 0;
  if (all) {
    last_fold_.erase(job);
    committed_.erase(job);
  } else if (auto c = committed_.find(job); c != committed_.end()) {
    c->second.erase(c->second.upper_bound(version), c->second.end());  // the timeline above is left
  }
  for (auto it = stripes_.lower_bound(Key{job, all ? 0 : version + 1, 0, 0});
       it != stripes_.end() && std::get<0>(it->first) == job;) {
    bytes_ -= it->second.parity->size();
    it = stripes_.erase(it);
    ++n;
  }
  return n;
}

void ParityStore::OnCommitted(const std::string& job, std::uint64_t version) {
  MutexLock lock(mu_);
  auto& c = committed_[job];
  c.insert(version);
  while (c.size() > versions_kept_) c.erase(c.begin());
  Retain(job);
}

void ParityStore::DropJobLocked(const std::string& job) {
  for (auto it = stripes_.lower_bound(Key{job, 0, 0, 0}); it != stripes_.end() && std::get<0>(it->first) == job;) {
    bytes_ -= it->second.parity->size();
    it = stripes_.erase(it);
  }
  last_fold_.erase(job);
  committed_.erase(job);
}

std::uint64_t ParityStore::parity_bytes() const {
  MutexLock lock(mu_);
  return bytes_;
}

std::uint64_t ParityStore::stripes() const {
  MutexLock lock(mu_);
  return stripes_.size();
}

}  // namespace ckpt
