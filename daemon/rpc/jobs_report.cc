#include "daemon/rpc/jobs_report.h"

#include <unistd.h>

#include <map>
#include <set>

namespace ckpt {

Status FillJobsReport(Daemon& daemon, const PeerCredentials& viewer, v1::JobsReply* reply) {
  const bool all = viewer.uid == 0 || viewer.uid == ::geteuid();
  auto on_disk = daemon.catalog().Jobs();
  if (!on_disk.ok()) return on_disk.status().With("list the jobs under " + daemon.catalog().root());
  std::set<std::string> jobs(on_disk->begin(), on_disk->end());
  std::map<std::string, std::uint32_t> sessions;
  for (const auto& s : daemon.sessions().All()) {
    ++sessions[s->job];
    jobs.insert(s->job);
  }
  const MemoryTier::Usage memory = daemon.tiers().memory().GetUsage();
  std::map<std::string, LocalTier::JobUsage> local;
  if (const LocalTier* tier = daemon.tiers().local()) local = tier->Usage();
  for (const auto& job : jobs) {
    if (!all && !daemon.owners().CheckAccess(job, viewer, "see").ok()) continue;
    auto* j = reply->add_jobs();
    j->set_job(job);
    j->set_sessions(sessions[job]);
    if (auto m = memory.jobs.find(job); m != memory.jobs.end())
      j->set_memory_bytes(m->second.bytes + m->second.replica_bytes);
    if (auto l = local.find(job); l != local.end()) j->set_local_bytes(l->second.bytes);
    auto owner = daemon.owners().Owner(job);
    if (!owner.ok()) {
      j->set_error(owner.status().message());
    } else if (owner.value()) {
      j->set_has_owner(true);
      j->set_owner_uid(owner.value()->uid);
      if (owner.value()->group) {
        j->set_has_group(true);
        j->set_owner_gid(*owner.value()->group);
      }
    }
    auto versions = daemon.catalog().List(job);
    if (!versions.ok()) {
      j->set_error(versions.status().With("list the versions of job '" + job + "'").message());
      continue;
    }
    std::uint32_t committed = 0;
    std::uint64_t bytes = 0;
    for (const auto& v : versions.value()) {
      if (v.committed) ++committed;
      bytes += daemon.catalog().VersionBytes(job, v);
    }
    j->set_versions(static_cast<std::uint32_t>(versions->size()));
    j->set_committed_versions(committed);
    j->set_bytes(bytes);
    j->set_latest_committed(daemon.catalog().RefreshLatest(job));
  }
  return Status::Ok();
}

}  // namespace ckpt
