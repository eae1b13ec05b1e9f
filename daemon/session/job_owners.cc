#include "daemon/session/job_owners.h"

#include <spdlog/spdlog.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "common/strings.h"

namespace ckpt {
namespace {

bool MayUse(const JobOwner& owner, const PeerCredentials& peer) {
  return peer.uid == 0 || peer.uid == owner.uid || (owner.group && InGroup(peer, *owner.group));
}

}  // namespace

bool InGroup(const PeerCredentials& peer, gid_t group) {
  return peer.gid == group || std::find(peer.groups.begin(), peer.groups.end(), group) != peer.groups.end();
}

Result<std::optional<JobOwner>> JobOwners::Read(const std::string& job) {
  const std::string path = tree_.OwnerFile(job);
  auto text = storage_->ReadSmallFile(path);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return std::optional<JobOwner>();
    return text.status().With("read the owner of job '" + job + "'");
  }
  auto owner = ParseJobOwner(text.value());
  if (!owner) {
    return FailedPrecondition(path +
                              " is not an owner file (expected 'uid=N' and an optional 'group=G' line); "
                              "refusing to serve job '" +
                              job + "' until it is repaired");
  }
  return std::optional<JobOwner>(*owner);
}

Status JobOwners::CheckAccess(const std::string& job, const PeerCredentials& peer, std::string_view action) {
  auto owner = Read(job);
  if (!owner.ok()) return owner.status();
  if (!owner.value() || MayUse(*owner.value(), peer)) return Status::Ok();
  return PermissionDenied("job '" + job + "' belongs to " + DescribeJobOwner(*owner.value()) + "; uid " +
                          std::to_string(peer.uid) + " may not " + std::string(action) + " it");
}

Status JobOwners::Claim(const std::string& job, const PeerCredentials& peer) {
  MutexLock lock(claim_mu_);
  auto found = Read(job);
  if (!found.ok()) return found.status();
  if (!found.value()) {
    JobOwner owner;
    owner.uid = peer.uid;
    if (job_group_ && InGroup(peer, *job_group_)) owner.group = *job_group_;
    // An older ckptd's job has checkpoints and no owner file. A directory that exists but
    // holds none is a job another daemon is creating at this moment (or an operator's
    // empty one): not an adoption.
    auto holds = HoldsCheckpoints(job);
    if (!holds.ok()) return holds.status().With("record the owner of job '" + job + "'");
    Status created = Create(job, owner, owner.group.value_or(peer.gid));
    if (created.ok()) {
      if (holds.value()) {
        spdlog::warn("job {} had no owner file (made by an older ckptd): adopted by {}, its first registrant",
                     job, DescribeJobOwner(owner));
      } else {
        spdlog::info("job {}: created, owned by {}", job, DescribeJobOwner(owner));
      }
      return Status::Ok();
    }
    if (created.code() != StatusCode::kAlreadyExists)
      return created.With("record the owner of job '" + job + "'");
    found = Read(job);  // another daemon was first: its owner holds
    if (!found.ok()) return found.status();
  }
  if (!found.value() || MayUse(*found.value(), peer)) return Status::Ok();
  return PermissionDenied("job '" + job + "' belongs to " + DescribeJobOwner(*found.value()) + "; uid " +
                          std::to_string(peer.uid) + " may not register it");
}

Result<bool> JobOwners::HoldsCheckpoints(const std::string& job) {
  auto names = storage_->List(tree_.JobDir(job));
  if (!names.ok()) {
    if (names.status().code() == StatusCode::kNotFound) return false;
    return names.status();
  }
  const std::string tmp_prefix = std::string(kOwnerFile) + ".";
  for (const std::string& name : names.value()) {
    // The owner file's temporary files (owner.NODE.tmp) are claims in progress.
    if (name == kOwnerFile || (name.starts_with(tmp_prefix) && EndsWith(name, kTmpSuffix))) continue;
    return true;
  }
  return false;
}

Status JobOwners::Create(const std::string& job, const JobOwner& owner, gid_t gid) {
  const std::string dir = tree_.JobDir(job);
  const bool existed = storage_->Exists(dir);
  // The job directory is durable before the file in it (and before any shard).
  if (Status st = storage_->MakeDirs(dir); !st.ok()) return st;
  if (Status st = storage_->SyncDir(tree_.root()); !st.ok()) return st;
  const std::string path = tree_.OwnerFile(job);
  const std::string tmp = path + TmpSuffix();
  const std::string content = FormatJobOwner(owner);
  {
    auto fd = storage_->CreateFile(tmp, /*direct=*/false);
    if (!fd.ok()) return fd.status();
    Status st = storage_->WriteAt(fd->get(), content.data(), content.size(), 0, tmp);
    if (st.ok()) st = storage_->DataSync(fd->get(), tmp);
    if (!st.ok()) {
      fd->reset();
      storage_->Remove(tmp);
      return st;
    }
  }
  // link() never replaces: of several daemons creating the file, one wins.
  Status linked = storage_->Link(tmp, path);
  storage_->Remove(tmp);
  // The daemon that made the directory hands it over, to the owner the winner of the link
  // recorded: of two daemons creating one job at once, the one that made the directory may
  // lose the link, and the winner, which found the directory there, leaves it alone. A
  // directory that existed before (made by an operator, or by an older ckptd) keeps its
  // owner and mode.
  if (existed) return linked.ok() ? storage_->SyncDir(dir) : linked;
  if (linked.code() == StatusCode::kAlreadyExists) {
    auto winner = Read(job);
    if (!winner.ok() || !winner.value()) return linked;  // Claim reads it again and says why
    const JobOwner& won = *winner.value();
    if (Status st = HandOver(job, won, won.group ? *won.group : PrimaryGroup(won.uid)); !st.ok()) return st;
    return linked;
  }
  if (!linked.ok()) return linked;
  if (Status st = HandOver(job, owner, gid); !st.ok()) return st;
  return storage_->SyncDir(dir);
}

Status JobOwners::HandOver(const std::string& job, const JobOwner& owner, gid_t gid) {
  if (owner.uid == ::geteuid()) return Status::Ok();
  const std::string dir = tree_.JobDir(job);
  Status chowned = storage_->SetOwner(dir, owner.uid, gid);
  if (chowned.code() == StatusCode::kPermissionDenied) {
    spdlog::debug("job {}: its directory stays uid {}'s ({}): this daemon may not chown", job, ::geteuid(),
                  chowned.message());
    return Status::Ok();
  }
  return chowned;
}

gid_t PrimaryGroup(uid_t uid) {
  struct passwd pw {};
  struct passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr)
    return static_cast<gid_t>(-1);  // chown leaves the group as it is
  return pw.pw_gid;
}

}  // namespace ckpt
