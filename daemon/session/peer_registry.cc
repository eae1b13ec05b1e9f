#include "daemon/session/peer_registry.h"

#include <sys/stat.h>

#include <cstdlib>

namespace ckpt {

void PeerRegistry::Forget(std::map<int, Entry>::iterator it) {
  auto count = per_uid_.find(it->second.creds.uid);
  if (count != per_uid_.end() && --count->second == 0) per_uid_.erase(count);
  by_fd_.erase(it);
}

void PeerRegistry::SweepClosed() {
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    struct stat st {};
    auto next = std::next(it);
    if (::fstat(it->first, &st) != 0 || st.st_ino != it->second.ino || st.st_dev != it->second.dev)
      Forget(it);
    it = next;
  }
}

std::string PeerRegistry::LimitPassed(uid_t uid) const {
  if (limits_.total != 0 && by_fd_.size() >= limits_.total) {
    return "the daemon holds " + std::to_string(by_fd_.size()) +
           " connections, the most --max-connections (" + std::to_string(limits_.total) +
           ") allows; refused a connection of uid " + std::to_string(uid);
  }
  auto it = per_uid_.find(uid);
  if (limits_.per_uid != 0 && it != per_uid_.end() && it->second >= limits_.per_uid) {
    return "uid " + std::to_string(uid) + " holds " + std::to_string(it->second) +
           " connections, the most --max-connections-per-uid (" + std::to_string(limits_.per_uid) +
           ") allows; refused another";
  }
  return {};
}

Status PeerRegistry::Add(int fd, PeerCredentials creds) {
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return Internal("fstat of accepted connection " + std::to_string(fd) + " failed");
  MutexLock lock(mu_);
  // A descriptor number gRPC closed and accept reused: that connection is gone.
  if (auto it = by_fd_.find(fd); it != by_fd_.end()) Forget(it);
  if (!LimitPassed(creds.uid).empty()) SweepClosed();
  if (std::string passed = LimitPassed(creds.uid); !passed.empty()) return ResourceExhausted(passed);
  ++per_uid_[creds.uid];
  by_fd_[fd] = Entry{std::move(creds), st.st_dev, st.st_ino};
  return Status::Ok();
}

std::optional<PeerCredentials> PeerRegistry::Lookup(const std::string& peer) const {
  constexpr std::string_view kPrefix = "fd:";
  if (peer.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  char* end = nullptr;
  long fd = std::strtol(peer.c_str() + kPrefix.size(), &end, 10);
  if (end == peer.c_str() + kPrefix.size()) return std::nullopt;
  MutexLock lock(mu_);
  auto it = by_fd_.find(static_cast<int>(fd));
  if (it == by_fd_.end()) return std::nullopt;
  return it->second.creds;
}

}  // namespace ckpt
