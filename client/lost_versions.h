// LostVersions: what the client knows of the versions whose sessions a daemon restart
// ended (ckpt/client.h, "A daemon restart"): the level each had reached, known before the
// restart or found on storage since, and whether an error has named it yet. Each lost
// version is reported once: the first error about the restart names every one not yet
// reported. A version found committed is not lost after all (nothing to report), but stays
// listed so that a wait on it still returns.
//
// Not thread-safe: Client::Impl's mutex guards it (client/session.h).
#pragma once

#include <google/protobuf/repeated_ptr_field.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "ckpt/client.h"
#include "ckpt/level.h"
#include "ckpt/v1/ckpt.pb.h"

namespace ckpt {

// Versions per session (and lost ones) whose reached level the client remembers; the daemon
// answers Wait for its newest 16 only, and admits at most 32 in flight.
inline constexpr std::size_t kVersionsTracked = 64;

class LostVersions {
 public:
  // The daemon went away: the versions of its session (version -> level known reached)
  // become lost, the newest kVersionsTracked kept. A committed one has nothing to report.
  void AddSession(const std::map<std::uint64_t, Level>& versions);
  // Lists `version` as reported, its level unknown, so that NoteListing can find it
  // committed; Forget it if it is not.
  void AddReported(std::uint64_t version);
  void Forget(std::uint64_t version);
  // Another registration (job or rank), or none: the versions lost so far are not its own.
  void Clear();

  bool Contains(std::uint64_t version) const;
  // The level `version` (listed) is known to have reached.
  Level Reached(std::uint64_t version) const;
  // Whether a lost version (not found committed) has not been named in an error yet.
  bool HasUnreported() const;
  // Those versions, "3, 4" (empty: none), for messages.
  std::string UnreportedList() const;

  // Brings each lost version up to what the daemon's listing of the job (ListReply.versions)
  // shows for `rank`.
  void NoteListing(const google::protobuf::RepeatedPtrField<v1::VersionInfo>& listed, std::uint32_t rank);
  // The error naming `first` (if set; it must be listed) and every other version not yet
  // reported, which count as reported from now on; `note` ends its message. nullopt if
  // there is nothing to report. Call NoteListing first.
  std::optional<DaemonRestartedError> Report(std::optional<std::uint64_t> first, const std::string& note);

 private:
  struct Lost {
    Level reached = Level::kNone;  // known before the restart, or found on storage since
    bool reported = false;         // named in an error already (or committed: nothing to report)
  };
  std::map<std::uint64_t, Lost> lost_;
};

}  // namespace ckpt
