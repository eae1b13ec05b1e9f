// Per-uid limits of what registrations hold, so that one uid cannot starve the others: the
// items of its open sessions (ItemBudget) and its registrations in progress at once
// (InFlightLimit). The connection limits are in rpc/peer_registry.h, the session limit in
// SessionTable::Add. A limit hit is ResourceExhausted naming the limit (its option) and the
// uid; the daemon goes on serving everyone else. A limit of 0 means none. Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "common/mutex.h"
#include "common/status.h"

namespace ckpt {

// Items registered by each uid, summed over its open sessions.
class ItemBudget {
 public:
  explicit ItemBudget(std::uint64_t per_uid) : per_uid_(per_uid) {}

  // Session `session` of `uid` now holds `items` items (in place of what it held): refused,
  // changing nothing, if that takes the uid past the limit.
  Status Resize(uid_t uid, const std::string& session, std::uint64_t items) EXCLUDES(mu_);
  // The session closed (or its registration failed).
  void Release(const std::string& session) EXCLUDES(mu_);

 private:
  const std::uint64_t per_uid_;
  Mutex mu_;
  std::map<std::string, std::pair<uid_t, std::uint64_t>> by_session_ GUARDED_BY(mu_);
  std::map<uid_t, std::uint64_t> by_uid_ GUARDED_BY(mu_);
};

// Calls of one kind in progress per uid (registrations).
class InFlightLimit {
 public:
  // `option` names the limit in messages ("--max-registrations-per-uid"), `what` the calls.
  InFlightLimit(std::uint32_t per_uid, std::string option, std::string what)
      : per_uid_(per_uid), option_(std::move(option)), what_(std::move(what)) {}

  // Held for the duration of one call.
  class Ticket {
   public:
    Ticket() = default;  // holds nothing
    Ticket(InFlightLimit* limit, uid_t uid) : limit_(limit), uid_(uid) {}
    Ticket(Ticket&& other) noexcept : limit_(std::exchange(other.limit_, nullptr)), uid_(other.uid_) {}
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    Ticket& operator=(Ticket&&) = delete;
    ~Ticket();

   private:
    InFlightLimit* limit_ = nullptr;
    uid_t uid_ = 0;
  };

  Result<Ticket> Enter(uid_t uid) EXCLUDES(mu_);

 private:
  void Leave(uid_t uid) EXCLUDES(mu_);

  const std::uint32_t per_uid_;
  const std::string option_;
  const std::string what_;
  Mutex mu_;
  std::map<uid_t, std::uint32_t> running_ GUARDED_BY(mu_);
};

}  // namespace ckpt
