// JobOwners: who a job belongs to, and who may use it.
//
// The uid that first registers a job owns it. Its owner file (ROOT/JOB/owner,
// format/job_owner.h) is created once on the persistent tier: written to a temporary file,
// fdatasync'ed, then hard-linked into place, so that of two daemons (two nodes) racing to
// create it exactly one wins, and every daemon sharing the root enforces the same owner. It
// is read again on every check (registrations, lists and prefetches are rare), so nothing
// cached can disagree with another node.
//
// Who may register the job (and so restore and snapshot it), list it and prefetch it: its
// owner, root (uid 0), and, when the owner file names a group (--job-group), that group's
// members. A job made by an older ckptd has no owner file: its first registration adopts it
// (logged as a warning); until then any allowed uid may list and prefetch it, as before. A
// job id nobody created has no owner either: listing it shows nothing. An owner file that
// cannot be parsed refuses everyone, naming the file, rather than guess. Thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/io/storage.h"
#include "daemon/session/peer_registry.h"
#include "format/job_owner.h"
#include "format/paths.h"

namespace ckpt {

class JobOwners {
 public:
  // `job_group`: the group recorded in the owner files of jobs whose first registrant is a
  // member of it (the job is then shared with that group); nullopt: jobs are never shared.
  JobOwners(std::shared_ptr<Storage> storage, std::string root, std::optional<gid_t> job_group)
      : storage_(std::move(storage)), tree_(std::move(root)), job_group_(job_group) {}

  // Whether `peer` may `action` ("list", "prefetch", "register") `job`: PermissionDenied
  // naming the job, its owner and the peer's uid if not.
  Status CheckAccess(const std::string& job, const PeerCredentials& peer, std::string_view action)
      EXCLUDES(claim_mu_);
  // For a registration: CheckAccess, and a job without an owner file becomes `peer`'s (its
  // directory is created, durably, first). The job directory then belongs to `peer` (uid,
  // and the job's group or else the peer's primary group) where the daemon may chown (root,
  // CAP_CHOWN; a daemon that may not leaves it its own), also when another daemon won the
  // owner file of a new job this daemon made the directory of. A directory that existed
  // before (an operator's, or an older ckptd's) is never chown'ed.
  Status Claim(const std::string& job, const PeerCredentials& peer) EXCLUDES(claim_mu_);
  // The job's owner, read from its owner file; nullopt if it has none.
  Result<std::optional<JobOwner>> Owner(const std::string& job) { return Read(job); }

 private:
  // The owner file's content; nullopt if there is none.
  Result<std::optional<JobOwner>> Read(const std::string& job);
  // Whether the job's directory holds anything but its owner file and claims in progress
  // (false if there is no directory).
  Result<bool> HoldsCheckpoints(const std::string& job);
  // Creates the owner file unless one exists; AlreadyExists if another writer was first.
  // `gid`: the group of the job directory, if this creates it.
  Status Create(const std::string& job, const JobOwner& owner, gid_t gid) REQUIRES(claim_mu_);
  // chown of the job's directory to `owner` (and `gid`), unless the daemon may not.
  Status HandOver(const std::string& job, const JobOwner& owner, gid_t gid);

  const std::shared_ptr<Storage> storage_;
  const CheckpointTree tree_;
  const std::optional<gid_t> job_group_;
  // Claims of this daemon share one temporary file name (NAME.NODE.tmp).
  Mutex claim_mu_;
};

// Whether `peer` is a member of `group` (its primary group or one of its supplementary ones).
bool InGroup(const PeerCredentials& peer, gid_t group);
// `uid`'s primary group in the user database; (gid_t)-1 (chown: unchanged) if it has none.
gid_t PrimaryGroup(uid_t uid);

}  // namespace ckpt
