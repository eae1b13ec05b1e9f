#include "daemon/session/uid_limits.h"

namespace ckpt {

Status ItemBudget::Resize(uid_t uid, const std::string& session, std::uint64_t items) {
  MutexLock lock(mu_);
  auto& [owner, held] = by_session_[session];
  owner = uid;
  std::uint64_t& total = by_uid_[uid];
  const std::uint64_t others = total - held;
  if (per_uid_ != 0 && others + items > per_uid_) {
    if (held == 0) by_session_.erase(session);
    if (total == 0) by_uid_.erase(uid);
    return ResourceExhausted("uid " + std::to_string(uid) + " would hold " + std::to_string(others + items) +
                             " items in its sessions (" + std::to_string(items) +
                             " in this registration), more than --max-items-per-uid allows (" +
                             std::to_string(per_uid_) + ")");
  }
  total = others + items;
  held = items;
  return Status::Ok();
}

void ItemBudget::Release(const std::string& session) {
  MutexLock lock(mu_);
  auto it = by_session_.find(session);
  if (it == by_session_.end()) return;
  auto total = by_uid_.find(it->second.first);
  if (total != by_uid_.end() && (total->second -= it->second.second) == 0) by_uid_.erase(total);
  by_session_.erase(it);
}

InFlightLimit::Ticket::~Ticket() {
  if (limit_) limit_->Leave(uid_);
}

Result<InFlightLimit::Ticket> InFlightLimit::Enter(uid_t uid) {
  MutexLock lock(mu_);
  std::uint32_t& running = running_[uid];
  if (per_uid_ != 0 && running >= per_uid_) {
    return ResourceExhausted("uid " + std::to_string(uid) + " has " + std::to_string(running) + " " + what_ +
                             " in progress, the most " + option_ + " allows (" + std::to_string(per_uid_) +
                             "); retry when one has finished");
  }
  ++running;
  return Ticket(this, uid);
}

void InFlightLimit::Leave(uid_t uid) {
  MutexLock lock(mu_);
  auto it = running_.find(uid);
  if (it != running_.end() && --it->second == 0) running_.erase(it);
}

}  // namespace ckpt
