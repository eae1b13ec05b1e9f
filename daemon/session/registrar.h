// Registrar: the life of a registration. Register checks that the caller may use the job
// (JobOwners), imports a trainer's descriptor table and regions (TableLoader), makes a new
// job the caller's, waits until the newest of the rank's shards from an earlier
// registration has settled (the one a restart restores; older ones are superseded by it:
// ShardRegistry::WaitRankNewestSettled), publishes the session (SessionTable) and records the rank's new
// registration id on the persistent tier (so that shards of an earlier run never complete a version of this
// one: see Catalog). A re-registration (same session) re-reads the table. Each uid has at
// most --max-registrations-per-uid of either in progress at once. Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/cancellable_wait.h"
#include "common/status.h"
#include "daemon/catalog/catalog.h"
#include "daemon/io/storage.h"
#include "daemon/pipeline/shard_registry.h"
#include "daemon/session/peer_registry.h"
#include "daemon/session/job_owners.h"
#include "daemon/session/session_table.h"
#include "daemon/session/table_loader.h"
#include "daemon/session/uid_limits.h"
#include "daemon/pipeline/promoter.h"

namespace ckpt {

struct RegistrationRequest {
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::string descriptor_table;
  DeviceRegistration device;
  ItemLayouts layouts;  // as the client sent them; TableLoader::Load checks them
  // Versions are sealed by the client, and verified by the daemon (see Session).
  bool sealed = false;
  bool verify = false;
};

struct Registered {
  std::shared_ptr<Session> session;
  std::uint32_t items = 0;
  std::uint64_t tensor_bytes = 0;
  std::vector<std::string> daemon_events;
  std::uint64_t latest_committed = 0;
  bool release_words = false;  // the session writes the trainer's release words
  bool sealed = false;
  bool verify = false;
};

class Registrar {
 public:
  // `promoter` may be null (no local tier).
  Registrar(Catalog& catalog, JobOwners& owners, TableLoader& loader, SessionTable& sessions,
            ShardRegistry& shards, std::uint32_t max_registrations_per_uid, ItemBudget& items,
            Promoter* promoter, bool restart_waits_newest)
      : catalog_(catalog),
        owners_(owners),
        loader_(loader),
        sessions_(sessions),
        shards_(shards),
        in_flight_(max_registrations_per_uid, "--max-registrations-per-uid", "registrations"),
        items_(items),
        promoter_(promoter),
        restart_waits_newest_(restart_waits_newest) {}

  // A new session for `peer`.
  Result<Registered> Register(const RegistrationRequest& req, const PeerCredentials& peer,
                              const CancelCheck& cancelled);
  // The session `s` registers again (its tensors were reallocated, its table changed). A GPU
  // session first lets its versions in flight be copied (they read the old tensors), and
  // the reply comes once the allocations the new table no longer names are closed: the
  // trainer may free them when it returns.
  Result<Registered> Reregister(const std::shared_ptr<Session>& s, const RegistrationRequest& req,
                                const CancelCheck& cancelled);
  // Writes a new registration id for the session's rank: what it published before belongs
  // to a timeline it left (a restore starts a new one), so its promotions still queued are
  // skipped.
  Status NewRegistration(Session& s) REQUIRES(s.mu);

 private:
  Registered Reply(const std::shared_ptr<Session>& s, std::vector<std::string> daemon_events) REQUIRES(s->mu);

  Catalog& catalog_;
  JobOwners& owners_;
  TableLoader& loader_;
  SessionTable& sessions_;
  ShardRegistry& shards_;
  InFlightLimit in_flight_;
  ItemBudget& items_;
  Promoter* const promoter_;
  // --restart-waits: false gives up the rank's versions in flight instead of waiting.
  const bool restart_waits_newest_;
};

}  // namespace ckpt
