// Session: one registration of a trainer process (one rank of one job), from Register to
// Unregister or the trainer's exit. Holds what the daemon imported for it (the descriptor
// table, the regions its items live in, the GPU events) and its versions in flight.
//
// Locking: `mu` serialises the calls that change a session (re-registration, snapshot,
// restore); `failures_mu` is separate because engine threads record failures and must never
// wait behind a long call (a Restore) holding `mu`; `regions_mu` guards the list of imported
// regions, which the reaper reads without waiting for `mu` when the trainer has exited.
// Fields without a lock are fixed when the session is created.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "backend/device_copier.h"
#include "backend/region_importer.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "daemon/pipeline/shard_job.h"
#include "daemon/session/peer_registry.h"
#include "shm/descriptor_table.h"

namespace ckpt {

// The global layouts of a registration: item name -> layout (unresolved), in the order sent.
using ItemLayouts = std::vector<std::pair<std::string, GlobalLayout>>;

struct Session {
  std::string id;
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  PeerCredentials peer;
  UniqueFd pidfd;
  std::shared_ptr<ImportedRegion> table;

  // Whether the trainer process has exited: its pidfd is readable, or, where no pidfd could
  // be opened, its pid no longer exists.
  bool TrainerExited() const;

  Mutex mu;
  std::uint64_t table_generation GUARDED_BY(mu) = 0;
  std::vector<TableItem> items GUARDED_BY(mu);
  std::vector<std::shared_ptr<ImportedRegion>> item_regions GUARDED_BY(mu);  // parallel to items
  // What every snapshot starts from, prepared once per table generation.
  std::shared_ptr<const TensorSet> tensors GUARDED_BY(mu);
  std::unordered_set<std::string> item_names GUARDED_BY(mu);
  // The global layouts of its last registration, as sent (TableLoader::Load resolves them
  // into `tensors`' items each time it reads the table).
  ItemLayouts layouts GUARDED_BY(mu);
  std::uint64_t tensor_bytes GUARDED_BY(mu) = 0;
  // The session's interprocess events (GPU sessions only).
  std::unique_ptr<SessionEvents> events GUARDED_BY(mu);
  // The rank's current registration id (session id and a counter bumped by each restore),
  // written to the persistent tier and into every shard: see Catalog.
  std::string registration GUARDED_BY(mu);
  std::uint64_t registrations GUARDED_BY(mu) = 0;
  std::uint64_t last_version GUARDED_BY(mu) = 0;
  // Sealed: a version is published only once the client sealed it (a wait with `seal`), and
  // dropped if the client aborts it or goes away first. Verify (implies sealed): the sealing
  // wait compares the host regions with the checksums of the copy. Set by each registration.
  bool sealed GUARDED_BY(mu) = false;
  bool verify GUARDED_BY(mu) = false;
  std::map<std::uint64_t, std::shared_ptr<ShardJob>> shards GUARDED_BY(mu);
  // Item ranges whose pages a restart's registration allocated while it waited
  // (Registrar::Register): the next restore does not allocate them again, since a second
  // fallocate of a tmpfs page allocated and never written zeroes it (a whole pass over the
  // memory). Cleared by that restore and by a re-registration.
  struct Preallocated {
    std::shared_ptr<ImportedRegion> region;
    std::uint64_t offset = 0, length = 0;
  };
  std::vector<Preallocated> preallocated GUARDED_BY(mu);

  // The device of its tensors (-1: host memory only); set under `mu`.
  std::atomic<int> device{-1};

  Mutex regions_mu;
  std::vector<std::shared_ptr<ImportedRegion>> regions
      GUARDED_BY(regions_mu);  // distinct, incl. none of the table

  Mutex failures_mu;
  std::set<std::uint64_t> unreported_failures GUARDED_BY(failures_mu);

  std::atomic<bool> open{true};
};

}  // namespace ckpt
